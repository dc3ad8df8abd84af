"""Propagation: shared, derived and fixed requests resolved into types once calibration has typed the
rest, the target's constraints checked where types meet (a rescale, or a float op, recorded)."""
