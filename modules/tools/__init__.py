"""Measuring instruments: calibration, measured tuning, the K = 0 equivalence check, memory audit."""
