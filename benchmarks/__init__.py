"""Side-by-side benchmarks of batchrun against transformers (`python -m benchmarks.run`, `make bench`).

`run` orchestrates; every system under test runs in its own `worker` subprocess so memory and threads of one
system never colour another's figures; `workload` makes the requests and counts their FLOPs; `report` writes
the JSON, Markdown and PNG.
"""
