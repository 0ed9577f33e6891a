"""Write failures (a full disk, a quota, an I/O error, a read-only filesystem) at each write a run makes: exit 1
with one line naming the file and the cause, no traceback, no temporary file left, every committed row kept,
and a rerun once the cause is gone completes every row once, in order.

The failures are injected where batchrun.output.files meets the operating system (its `os`), in-process on the
fake engine; one test fills a real tiny tmpfs where mounting one is permitted."""

import errno
import json
import os
import shutil
import subprocess

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from test_job_fakes import cli_env, read_rows, run_cli, write_job

from batchrun.cli import main
from batchrun.output import files
from batchrun.output.folder import TMP_RE

N_ROWS = 22
IDS = [f"r{i:02d}" for i in range(N_ROWS)]


class FailingOs:
    """`os` as batchrun.output.files sees it, with one operation failing on files whose name contains `target`,
    after `after` calls of that operation on them have gone through."""

    def __init__(self, op: str, target: str, err: int, after: int = 0) -> None:
        self.op, self.target, self.err, self.after = op, target, err, after
        self.paths: dict[int, str] = {}  # open descriptors -> their path
        self.failures = 0

    def __getattr__(self, name):
        return getattr(os, name)

    def _maybe_fail(self, op: str, path: str) -> None:
        if op == self.op and self.target in os.path.basename(path):
            if self.after > 0:
                self.after -= 1
                return
            self.failures += 1
            raise OSError(self.err, os.strerror(self.err))

    def open(self, path, flags, mode=0o777, *args, **kwargs):
        self._maybe_fail("open", str(path))
        fd = os.open(path, flags, mode, *args, **kwargs)
        self.paths[fd] = str(path)
        return fd

    def write(self, fd, data):
        self._maybe_fail("write", self.paths.get(fd, ""))
        return os.write(fd, data)

    def pwrite(self, fd, data, offset):
        self._maybe_fail("write", self.paths.get(fd, ""))
        return os.pwrite(fd, data, offset)

    def fsync(self, fd):
        self._maybe_fail("fsync", self.paths.get(fd, ""))
        return os.fsync(fd)

    def replace(self, src, dst):
        self._maybe_fail("replace", str(dst))
        return os.replace(src, dst)


@pytest.fixture
def job(tmp_path):
    pq.write_table(pa.table({"id": IDS, "prompt": [f"prompt number {i}" for i in range(N_ROWS)]}),
                   tmp_path / "in.parquet")
    return write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.parquet")},
                     output={"path": str(tmp_path / "out"), "rows_per_part": 4})


def cli(*args):
    return CliRunner().invoke(main, [str(a) for a in args], env={"BATCHRUN_LLM_FACTORY": "test_job_fakes:FakeLLM"})


def leftovers(out):
    return [p.name for p in out.iterdir() if TMP_RE.match(p.name)]


CASES = [  # (operation, file, after): the write that fails
    ("write", "part-", 2),  # the third part's bytes
    ("fsync", "part-", 1),
    ("replace", "part-", 3),
    ("open", "part-", 0),  # the very first part
    ("write", "_manifest.json", 1),  # the second part's entry: the part is never renamed into place
    ("replace", "_manifest.json", 3),
    ("write", "_metrics.json", 0),  # every row committed, the metrics not
    ("replace", "_SUCCESS", 0),  # metrics written, the completion mark not
    ("open", "_job.json", 0),  # before anything runs
]
ERRORS = [errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS]


@pytest.mark.parametrize("op,target,after", CASES)
@pytest.mark.parametrize("err", ERRORS, ids=[errno.errorcode[e] for e in ERRORS])
def test_a_failed_write_exits_1_in_one_line_and_the_rerun_completes(job, tmp_path, monkeypatch, op, target, after,
                                                                     err):
    out = tmp_path / "out"
    failing = FailingOs(op, target, err, after)
    monkeypatch.setattr(files, "os", failing)
    result = cli("run", job)
    monkeypatch.undo()
    assert failing.failures == 1
    assert result.exit_code == 1, result.output
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and "Traceback" not in result.output, result.stderr
    name = f"{errno.errorcode[err]})"
    assert lines[0].startswith(f"batchrun: error: cannot write {out}/") and name in lines[0]
    assert os.strerror(err) in lines[0] and target in lines[0]
    assert leftovers(out) == []
    assert not (out / "_SUCCESS").exists()
    committed = read_rows(out) if list(out.glob("part-*")) else []
    assert [r["id"] for r in committed] == IDS[:len(committed)]  # what was committed is whole and in order
    rerun = cli("run", job)
    assert rerun.exit_code == 0, rerun.output
    rows = read_rows(out)
    assert [r["id"] for r in rows] == IDS and all(r["error"] is None for r in rows)
    assert (out / "_SUCCESS").exists() and leftovers(out) == []
    assert json.loads((out / "_metrics.json").read_text())["output_rows"] == N_ROWS


def test_a_failure_to_keep_rows_aside(job, tmp_path, monkeypatch):
    """_ahead.parquet (rows finished ahead, kept at each timed commit): the same one line, and nothing lost."""
    monkeypatch.setenv("BATCHRUN_FAKE_DELAY", "0.02")
    failing = FailingOs("write", "_ahead.parquet", errno.ENOSPC)
    monkeypatch.setattr(files, "os", failing)
    result = cli("run", job, "--set", "output.commit_interval_s=0.1")
    monkeypatch.undo()
    assert failing.failures == 1 and result.exit_code == 1
    assert "cannot write" in result.stderr and "_ahead.parquet: No space left on device (ENOSPC)" in result.stderr
    assert "Traceback" not in result.output and leftovers(tmp_path / "out") == []
    assert cli("run", job).exit_code == 0
    assert [r["id"] for r in read_rows(tmp_path / "out")] == IDS


def test_openai_batch_output_write_failure(tmp_path, monkeypatch):
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": "m", "prompt": f"hello {i}", "max_tokens": 3}} for i in range(9)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.jsonl"), "format": "openai-batch"},
                    output={"path": str(tmp_path / "out"), "rows_per_part": 3})
    monkeypatch.setattr(files, "os", FailingOs("write", "output.jsonl", errno.ENOSPC, after=1))
    result = cli("run", job)
    monkeypatch.undo()
    assert result.exit_code == 1 and "output.jsonl: No space left on device (ENOSPC)" in result.stderr
    assert "Traceback" not in result.output
    kept = (tmp_path / "out" / "output.jsonl").read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in kept] == ["c0", "c1", "c2"]  # cut back to what was committed
    assert cli("run", job).exit_code == 0
    done = (tmp_path / "out" / "output.jsonl").read_text().splitlines()
    assert [json.loads(x)["custom_id"] for x in done] == [f"c{i}" for i in range(9)]


@pytest.fixture
def tiny_fs(tmp_path):
    """A 160 KiB tmpfs (root, or a user allowed to mount); unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if shutil.which("mount") is None:
        pytest.skip("no mount command on this machine")
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(mnt)], capture_output=True)
    if made.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here ({made.stderr.decode().strip()[:100]})")
    yield mnt
    subprocess.run(["umount", str(mnt)], capture_output=True)


def test_a_real_full_filesystem_then_room_made(tmp_path, tiny_fs):
    n = 1000  # prompts of 200 random hex digits, kept in the output: about 200 KB that do not compress away
    prompts = [os.urandom(100).hex() for _ in range(n)]
    pq.write_table(pa.table({"id": list(range(n)), "prompt": prompts}), tmp_path / "in.parquet")
    job = write_job(tmp_path / "job.yaml", input={"path": str(tmp_path / "in.parquet")},
                    engine={"max_num_seqs": 64},
                    output={"path": str(tiny_fs / "out"), "rows_per_part": 50, "include_prompt": True})
    full = run_cli(["run", job, "-q"], env=cli_env(fake=True))
    assert full.returncode == 1, full.stderr
    assert "No space left on device (ENOSPC)" in full.stderr and "Traceback" not in full.stderr
    assert full.stderr.count("batchrun: error:") == 1
    out = tiny_fs / "out"
    assert leftovers(out) == []
    committed = [r["id"] for r in read_rows(out)] if list(out.glob("part-*")) else []
    assert committed == list(range(len(committed))) and len(committed) < n
    subprocess.run(["mount", "-o", "remount,size=64m", str(tiny_fs)], check=True)
    done = run_cli(["run", job, "-q"], env=cli_env(fake=True))
    assert done.returncode == 0, done.stderr
    assert [r["id"] for r in read_rows(out)] == list(range(n)) and (out / "_SUCCESS").exists()
