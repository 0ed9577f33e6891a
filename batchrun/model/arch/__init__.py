"""Model families, one module each, composed from the shared blocks (blocks.py). Which architecture names each
one loads, and what is verified for it, is batchrun/model/arch/registry.py."""
