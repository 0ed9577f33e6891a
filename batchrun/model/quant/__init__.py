"""Quantized linears: the module on the kernels, GPTQ rounding and calibration."""
