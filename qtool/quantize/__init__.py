"""Turning a float model plus statistics into a QDQ model: layout, parameters, graph writing."""
