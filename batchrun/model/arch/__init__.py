"""Model families, one module each, built from blocks.py; registry.py says which architectures each loads."""
