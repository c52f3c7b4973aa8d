"""Calibration: stream data through the float model and keep bounded-size statistics per tensor."""
