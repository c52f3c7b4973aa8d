"""One orchestrator per command (calibrate, quantize, qat, evaluate, analyze, stats merge): the
only code that reads a Recipe. Each turns the recipe into the typed inputs of the stages below,
runs them in order and commits every output file together."""
