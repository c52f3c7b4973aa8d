"""Data sources (npz, npy, image folders, Python functions, text, synthetic) read as batches of
model inputs, re-batched to the size a stage asks for, with labels where the source has them."""
