"""Weight encoding: each kernel's int8 weights stored as the target's kernels read them (no int16 pair
can saturate, where they add pairs), rounded against their calibration inputs (error feedback)."""
