"""The reference's core: quantized arrays and the arithmetic behind them.

QArray and quantize/dequantize (qarray, with its shape ops and helpers), the qtypes and their
element conversions (qtypes, numerics), tiled and channelwise scales (tiling), calibration of
ranges, moving averages of statistics, stochastic rounding and sparsity. Everything above builds
on these modules; they import nothing else of the engine. The arithmetic of
docs/numerics-spec.md lives here.
"""
