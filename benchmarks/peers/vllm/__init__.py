"""vLLM's CPU build as a peer: its venv, its worker, and the quantized checkpoints it reads."""
