"""The job's output path: run.py runs one (lock, status, writer, drive, metrics); rows in any order -> OrderedWriter
-> Sink -> atomic files, with the manifest, patches of recomputed rows and verify beside it."""
