"""sentence-transformers as the embedding rows' reference peer: its venv and its worker."""
