"""Fusion: rewrites of op patterns into the fused kernels ONNX Runtime runs faster (and back where it does not)."""
