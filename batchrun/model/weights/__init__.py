"""Where weights come from: locating a model, built-in models, safetensors / GGUF / compressed-tensors loading."""
