"""How close a quantized model is to its float model.

signal (the one SQNR / cosine / top-1 accumulator, numpy only, usable from every layer),
results (what an evaluation found), inputs, model_files and provenance_check (what evaluate
checks before it runs), kinds (which rows an output gets), labels (accuracy), evaluate (the
loop), fusion_gap (fused vs unfused), gates and junit (CI), tables (what is printed), spec (the
recipe's evaluation: section)."""
