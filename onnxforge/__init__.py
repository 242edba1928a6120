"""onnxforge: verified, measured ONNX graph optimization as a service."""

__version__ = "0.1.0"
