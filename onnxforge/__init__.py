"""onnxforge: verified, measured ONNX graph optimization as a service."""

from core.version import __version__

__all__ = ["__version__"]
