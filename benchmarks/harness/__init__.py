"""What `python -m benchmarks.run` is made of: plans, workloads, workers, the clock and the report."""
