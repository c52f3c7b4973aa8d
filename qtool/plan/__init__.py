"""The Plan: one decision per graph node (precision, weight format, activation method, and why),
built from the user's settings and the per-target op rules; every later stage reads it."""
