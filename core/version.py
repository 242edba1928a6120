"""The onnxforge version, on the ground floor so that every floor can stamp it."""

__version__ = "0.1.0"
