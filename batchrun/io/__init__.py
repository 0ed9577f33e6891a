"""Job input: streaming sources, which rows a run reads, and row -> request preparation."""
