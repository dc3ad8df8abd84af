"""Transforms: what changes the float model (smoothing, equalization) or the quantized one's numbers
(bias correction) so that the int8 model computes closer to float."""
