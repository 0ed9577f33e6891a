"""The job's output: rows in any order -> OrderedWriter -> ordered parts (Sink) -> atomic files, with the lock,
the manifest, patches of recomputed rows and verify beside it."""
