"""Quantization and precision: int8 quantization, float16 and mixed precision."""
