"""Quantization providers: one quantization mode per module."""
