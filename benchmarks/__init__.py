"""batchrun's benchmarks: beside its CPU peers (`python -m benchmarks.run`), kernel by kernel, on a GPU."""
