"""Executors (executor.py, local.py; Ray's in distributed/) and the JobEngine protocol they drive (engine_api.py)."""
