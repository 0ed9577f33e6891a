"""The CUDA path's check: what a session lent a GPU runs (`bash benchmarks/gpu/session.sh`)."""
