"""One run per output folder: a second run (or a merge) of a folder in use exits 2 at once naming the holder;
a run killed with SIGKILL never blocks the next one; a filesystem without flock falls back to the holder's
record (fake engine: this is about the folder, not generation)."""

import errno
import fcntl
import json
import os
import socket
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_job_fakes import batchrun_cmd, cli_env, read_rows, run_cli, write_job

from batchrun.cli import main
from batchrun.output.lock import LOCK_FILE, Holder, OutputBusy, OutputLock

N_ROWS = 24


@pytest.fixture
def job(tmp_path):
    pq.write_table(pa.table({"id": [f"r{i:02d}" for i in range(N_ROWS)],
                             "prompt": [f"prompt number {i}" for i in range(N_ROWS)]}), tmp_path / "in.parquet")
    return write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.parquet")},
                     output={"path": str(tmp_path / "out"), "rows_per_part": 4})


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], env={"BATCHRUN_LLM_FACTORY": "test_job_fakes:FakeLLM"})


def start_slow(job_path, *extra, delay=0.2):
    env = cli_env(fake=True, BATCHRUN_FAKE_DELAY=str(delay))
    return subprocess.Popen(batchrun_cmd() + ["run", job_path, "-q", *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for(proc, path, timeout=60):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.02)


def test_second_run_exits_2_naming_the_holder_and_sigkill_never_blocks(job, tmp_path):
    out = tmp_path / "out"
    first = start_slow(job)
    try:
        wait_for(first, out / "part-00000.parquet")
        t0 = time.monotonic()
        second = run_cli(["run", job], env=cli_env(fake=True))
        assert time.monotonic() - t0 < 30  # at once: no model is loaded, nothing waits
        assert second.returncode == 2, second.stderr
        line = second.stderr.strip()
        assert line.count("\n") == 0 and "Traceback" not in line
        assert f"{out} is in use by another batchrun" in line
        assert f"pid {first.pid}" in line and socket.gethostname() in line and "since 20" in line
        assert not (out / "_SUCCESS").exists()
    finally:
        first.kill()  # SIGKILL: the kernel drops its flock; its record stays behind
        first.wait(timeout=30)
    assert json.loads((out / LOCK_FILE).read_text())["pid"] == first.pid
    rerun = run_cli(["run", job], env=cli_env(fake=True))
    assert rerun.returncode == 0, rerun.stderr
    assert [r["id"] for r in read_rows(out)] == [f"r{i:02d}" for i in range(N_ROWS)]
    assert (out / LOCK_FILE).read_text() == ""  # released: the record says nobody holds it


def test_a_held_folder_refuses_in_process_and_frees_after_release(job, tmp_path):
    out = tmp_path / "out"
    with OutputLock(out, "test"):
        busy = cli("run", job)
        assert busy.exit_code == 2 and f"pid {os.getpid()}" in busy.stderr
        assert not list(out.glob("part-*"))  # nothing touched
        with pytest.raises(OutputBusy):
            OutputLock(out).acquire()  # another open of the file: refused even in the same process
    ok = cli("run", job)
    assert ok.exit_code == 0, ok.output
    assert len(read_rows(out)) == N_ROWS


def test_merge_refuses_while_a_shard_runs(job, tmp_path):
    out = tmp_path / "out"
    assert cli("run", job, "--shard", "0/2").exit_code == 0
    running = start_slow(job, "--shard", "1/2")
    try:
        wait_for(running, out / "shard-1-of-2" / "part-00000.parquet")
        merged = run_cli(["merge", out], env=cli_env(fake=True))
        assert merged.returncode == 2, merged.stderr
        assert f"{out / 'shard-1-of-2'} is in use by another batchrun" in merged.stderr
        assert f"pid {running.pid}" in merged.stderr and merged.stderr.strip().count("\n") == 0
        assert not (tmp_path / "out-merged" / "_SUCCESS").exists()
    finally:
        running.kill()
        running.wait(timeout=30)
    assert cli("run", job, "--shard", "1/2").exit_code == 0
    merged = cli("merge", out)
    assert merged.exit_code == 0, merged.output
    assert [r["id"] for r in read_rows(tmp_path / "out-merged")] == [f"r{i:02d}" for i in range(N_ROWS)]


def test_a_run_cannot_start_while_a_merge_holds_its_shard(job, tmp_path):
    out = tmp_path / "out"
    with OutputLock(out / "shard-0-of-2", "merge"):
        busy = cli("run", job, "--shard", "0/2", "--no-resume")
        assert busy.exit_code == 2 and "in use by another batchrun" in busy.stderr


# ---------------------------------------------------------------- filesystems without flock


def _no_flock(monkeypatch, err=errno.ENOLCK):
    def flock(fd, op):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(fcntl, "flock", flock)


def _record(folder, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    holder = {"host": socket.gethostname(), "pid": 1, "since": "2026-01-01 00:00:00 +0000", "command": "x", **fields}
    (folder / LOCK_FILE).write_text(json.dumps(holder))


def test_without_flock_a_live_holder_on_this_host_refuses(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _record(tmp_path / "out", pid=sleeper.pid)
        with pytest.raises(OutputBusy, match=f"pid {sleeper.pid}"):
            OutputLock(tmp_path / "out").acquire()
    finally:
        sleeper.kill()
        sleeper.wait()


@pytest.mark.parametrize("host", ["this", "elsewhere"])
def test_without_flock_a_dead_or_unknown_holder_is_taken_over_with_a_warning(tmp_path, monkeypatch, caplog, host):
    _no_flock(monkeypatch, errno.ENOSYS)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _record(tmp_path / "out", pid=dead.pid, host=socket.gethostname() if host == "this" else "node-elsewhere-17")
    with OutputLock(tmp_path / "out"):
        assert Holder.parse((tmp_path / "out" / LOCK_FILE).read_text()).pid == os.getpid()
    assert "this filesystem has no flock" in caplog.text
    assert ("cannot be checked from this host" in caplog.text) == (host == "elsewhere")


def test_a_lock_still_held_for_a_dead_process_says_so(tmp_path, monkeypatch):
    """NFS: the server may hold a dead client's lock for a while; the message says what is going on."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    _record(tmp_path / "out", pid=dead.pid)

    def flock(fd, op):
        raise BlockingIOError(errno.EWOULDBLOCK, "busy")

    monkeypatch.setattr(fcntl, "flock", flock)
    with pytest.raises(OutputBusy, match="no longer running.*remove .*_lock"):
        OutputLock(tmp_path / "out").acquire()
