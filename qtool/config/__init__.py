"""Recipes: YAML loading with bounds (yaml_load.py), `base:` presets and their inheritance rules,
and the validation that turns a file into a typed Recipe. Only qtool/app reads a Recipe."""
