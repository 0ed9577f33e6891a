"""Streaming: an input far larger than the memory bound runs with bounded resident memory.

The input carries a 128 KiB pass-through column per row (500 MiB in all once decoded, compressed to a few
MiB on disk); prompts stay short so the (fake) engine's work is small. Past the working set (a read batch,
the rows in flight, one output part) peak RSS stays flat: the 500 MiB run peaks within BOUND_MIB of a run on
a fifth of the rows. Memory is asserted, not time."""

import os
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
from test_job_fakes import batchrun_cmd, cli_env, write_job

PAYLOAD = 128 * 1024
MID_ROWS, BIG_ROWS = 1_000, 4_000  # 125 MiB and 500 MiB of payload
BOUND_MIB = 120  # allocator noise is tens of MiB; holding the extra input would be 375 MiB


def write_input(path, rows, chunk=1000):
    schema = pa.schema([("id", pa.int64()), ("prompt", pa.string()), ("payload", pa.string())])
    # small write batches keep pages near 1 MiB, as real writers do for wide rows (pages are read whole)
    with pq.ParquetWriter(path, schema, compression="zstd", write_batch_size=8) as w:
        for lo in range(0, rows, chunk):
            n = min(chunk, rows - lo)
            ids = list(range(lo, lo + n))
            w.write_table(pa.table({"id": ids, "prompt": [f"row {i} says" for i in ids],
                                    "payload": [f"{i:08d}" + "z" * (PAYLOAD - 8) for i in ids]}, schema=schema))


def peak_rss_mib(job, out_log):
    env = cli_env(fake=True)
    with open(out_log, "w") as log:
        proc = subprocess.Popen(batchrun_cmd() + ["run", job, "--quiet"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    assert proc.returncode == 0, open(out_log).read()[-2000:]
    return usage.ru_maxrss / 1024  # KiB on Linux


def test_large_input_runs_in_bounded_memory(tmp_path):
    peaks = {}
    for name, rows in (("mid", MID_ROWS), ("big", BIG_ROWS)):
        d = tmp_path / name
        d.mkdir()
        write_input(d / "in.parquet", rows)
        job = write_job(d / "job.yaml", input={"path": str(d / "in.parquet"), "keep_columns": ["payload"]},
                        sampling={"max_tokens": 1}, engine={"max_num_seqs": 32},
                        output={"path": str(d / "out"), "rows_per_part": 200})
        peaks[name] = peak_rss_mib(job, d / "log.txt")
        assert pq.read_metadata(d / "out" / "part-00000.parquet").num_rows == 200
    out = tmp_path / "big" / "out"
    total = sum(pq.read_metadata(p).num_rows for p in out.glob("part-*.parquet"))
    assert total == BIG_ROWS
    last = pq.read_table(sorted(out.glob("part-*.parquet"))[-1], columns=["id", "payload"]).to_pylist()[-1]
    assert last["id"] == BIG_ROWS - 1 and last["payload"].startswith(f"{BIG_ROWS - 1:08d}zzz")
    input_mib = BIG_ROWS * PAYLOAD / 2**20
    growth = peaks["big"] - peaks["mid"]
    assert growth < BOUND_MIB, f"peak RSS grew by {growth:.0f} MiB for {input_mib:.0f} MiB of input ({peaks})"
