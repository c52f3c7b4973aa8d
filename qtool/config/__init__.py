"""Reading configuration files (recipes, presets) safely: the YAML loader lives here, apart from
the recipe's schema, so that every YAML file qtool reads goes through one set of limits."""
