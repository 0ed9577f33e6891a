"""The data layouts the model and both kernel families share: quantized weights, 8-bit KV cache rows."""
