"""Simulator against hardware: the measured validation matrix, the host-issue calibration, schedule changes."""
