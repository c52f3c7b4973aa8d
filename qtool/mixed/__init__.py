"""Automatic mixed precision: per-node precisions chosen under an accuracy budget."""
