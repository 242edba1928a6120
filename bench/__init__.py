"""Benchmarks: scripts that measure onnxforge's passes and presets (see bench/README.md)."""
