"""`make test-cluster`: jobs/slurm_array.sh under a real Slurm, submitted as a user submits it.

It installs Debian's slurm-wlm and munge when they are missing (apt-get, as root), starts munged, slurmctld and
slurmd directly (no systemd) on a one-node slurm.conf (proctrack/linuxproc, task/none, select/cons_tres, no
accounting, MinJobAge long enough to read exit codes), clones the repository into a temporary folder, and
there:

1. runs the check job once without Slurm (the reference rows);
2. submits `sbatch --array=0-2 --cpus-per-task=1 jobs/slurm_array.sh JOB` (the script as shipped otherwise),
   each task's first row slow so that rows finish out of input order;
3. once tasks 0 and 1 have finished a few rows, sends task 0 SIGTERM as a time limit does
   (`scancel --signal=TERM --batch`) and task 1 a real SIGKILL (`scancel -s KILL --batch`);
4. checks the exit codes (143; killed by signal 9; 0), the logs (in the submit folder, threads from
   SLURM_CPUS_PER_TASK), and counts the rows each interrupted task left on disk (parts and rows kept aside);
5. resubmits the same array, merges, verifies: every row once, in input order, equal to the reference, the
   complete task skipped, and each interrupted task's rerun computing only the rows it had not finished.

Prints one line per check and a summary; exits 0 when all hold. The engine is the real one on a tiny model;
each finished request is handed out 0.4 s apart (tests/test_job_fakes.py: PacedLLM) so the signals land
half way. Run with the repository's Python: `make test-cluster`, or `python tests/cluster/slurm_check.py`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROWS, TASKS = 36, 3
PER_TASK = ROWS // TASKS
results: list[tuple[bool, str]] = []


def sh(cmd: list[str], *, check: bool = True, env: dict | None = None, cwd: Path | None = None,
       timeout: float = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)
    if check and proc.returncode != 0:
        raise SystemExit(f"slurm_check: {' '.join(cmd)} failed ({proc.returncode}): {proc.stderr.strip()[-2000:]}")
    return proc


def check(ok: bool, what: str) -> bool:
    results.append((ok, what))
    print(f"{'ok  ' if ok else 'FAIL'} {what}", flush=True)
    return ok


# ---------------------------------------------------------------- the cluster


def install() -> None:
    if shutil.which("slurmctld") and shutil.which("munged"):
        return
    if os.geteuid() != 0:
        raise SystemExit("slurm_check: slurm-wlm and munge are not installed, and installing them needs root")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    sh(["apt-get", "update", "-qq"], env=env)
    sh(["apt-get", "install", "-y", "-qq", "--no-install-recommends", "slurm-wlm", "munge"], env=env)


class Cluster:
    """munged, slurmctld and slurmd of a one-node cluster whose state lives in `root`; stopped by `stop`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.conf = root / "slurm.conf"
        self.pids: list[Path] = []
        self.env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
        self.env["SLURM_CONF"] = str(self.conf)

    def start(self) -> None:
        self._munge()
        host = socket.gethostname().split(".")[0]
        mem_mb = int(next(line.split()[1] for line in open("/proc/meminfo") if line.startswith("MemTotal"))) // 1024
        for d in ("ctld", "d", "log"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        self.conf.write_text("\n".join([
            "ClusterName=batchruncheck", f"SlurmctldHost={host}(127.0.0.1)", "SlurmctldPort=16817",
            "SlurmdPort=16818", "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "SchedulerType=sched/backfill", "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2", "MinJobAge=3600", "KillWait=30", "InactiveLimit=0",
            f"StateSaveLocation={self.root / 'ctld'}", f"SlurmdSpoolDir={self.root / 'd'}",
            f"SlurmctldPidFile={self.root / 'slurmctld.pid'}", f"SlurmdPidFile={self.root / 'slurmd.pid'}",
            f"SlurmctldLogFile={self.root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={self.root / 'log' / 'slurmd.log'}",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs={os.cpu_count()} RealMemory={mem_mb - 512} State=UNKNOWN",
            "PartitionName=check Nodes=ALL Default=YES MaxTime=INFINITE State=UP", ""]))
        sh(["slurmctld", "-c", "-f", str(self.conf)], env=self.env)
        self.pids.append(self.root / "slurmctld.pid")
        sh(["slurmd", "-f", str(self.conf)], env=self.env)
        self.pids.append(self.root / "slurmd.pid")
        deadline = time.monotonic() + 60
        while True:
            state = sh(["sinfo", "-h", "-o", "%T"], check=False, env=self.env).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"slurm_check: the node did not come up (sinfo: {state!r}); see {self.root / 'log'}")
            time.sleep(1)

    def _munge(self) -> None:
        if sh(["sh", "-c", "munge -n | unmunge"], check=False).returncode == 0:
            return  # a munged is already running: leave it be
        key = Path("/etc/munge/munge.key")
        if not key.exists():
            sh(["mungekey", "--create", "--keyfile", str(key)])
        for d in ("/run/munge", "/var/log/munge", "/var/lib/munge", "/etc/munge"):
            Path(d).mkdir(parents=True, exist_ok=True)
            shutil.chown(d, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        key.chmod(0o400)
        sh(["runuser", "-u", "munge", "--", "/usr/sbin/munged"])
        self.pids.append(Path("/run/munge/munged.pid"))

    def stop(self) -> None:
        for pid_file in reversed(self.pids):
            try:
                os.kill(int(pid_file.read_text().split()[0]), 15)
            except (OSError, ValueError):
                pass

    def sbatch(self, cwd: Path, env: dict, *args: str) -> str:
        return sh(["sbatch", "--parsable", *args], env={**env, "SLURM_CONF": str(self.conf)}, cwd=cwd).stdout.strip()

    def running(self, job: str) -> list[str]:
        return sh(["squeue", "-h", "-j", job, "-o", "%i %T"], check=False, env=self.env).stdout.split("\n")

    def wait_done(self, job: str, timeout: float = 900) -> None:
        deadline = time.monotonic() + timeout
        while any(line.strip() for line in self.running(job)):
            if time.monotonic() > deadline:
                raise SystemExit(f"slurm_check: job {job} still running after {timeout:.0f} s")
            time.sleep(1)

    def task(self, job: str, index: int) -> dict[str, str]:
        """scontrol's fields of one array task, e.g. JobState, ExitCode."""
        text = sh(["scontrol", "show", "job", f"{job}_{index}"], env=self.env).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))


# ---------------------------------------------------------------- the job


def write_job(data: Path, out: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    words = "the cat sits on a warm stone near the river while the old farmer reads a long letter".split()
    prompts = [" ".join(words[i % 9: i % 9 + 3 + i % 4]) for i in range(ROWS)]
    budget = [48 if i % PER_TASK == 0 else 4 for i in range(ROWS)]  # each task's first row is slow
    pq.write_table(pa.table({"id": [f"r{i:02d}" for i in range(ROWS)], "prompt": prompts, "budget": budget}),
                   data / "in.parquet")
    job = data / "job.yaml"
    job.write_text(f"""model: {{path: "builtin:tiny-llama"}}
input: {{path: {data / 'in.parquet'}, sampling_columns: {{max_tokens: budget}}}}
sampling: {{max_tokens: 4, temperature: 0.0}}
engine: {{max_num_seqs: 4, kv_cache_memory: 64MiB}}
output: {{path: {out}, rows_per_part: 4, commit_interval_s: 0.5}}
""")
    return job


def rows_on_disk(shard: Path) -> set[int]:
    """Input positions the shard holds: in committed parts and kept aside (what a rerun does not compute)."""
    import pyarrow.parquet as pq

    done: set[int] = set()
    for _ in range(5):  # a part may be renamed while listed
        try:
            done = set()
            for part in sorted(shard.glob("part-*.parquet")):
                info = json.loads(pq.read_metadata(part).metadata[b"batchrun"])
                done.update(range(info["start"], info["end"]))
            ahead = shard / "_ahead.parquet"
            if ahead.exists():
                meta = json.loads(pq.read_metadata(ahead).metadata[b"batchrun"])
                done.update(row[0] for row in meta["rows"])
            return done
        except (OSError, ValueError, KeyError):
            time.sleep(0.1)
    return done


def read(folder: Path) -> list[dict]:
    import pyarrow.parquet as pq

    return pq.read_table(str(folder)).to_pylist()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (clone, logs, state)")
    opts = parser.parse_args()
    install()
    tmp = Path(tempfile.mkdtemp(prefix="batchrun-cluster-"))
    cluster = Cluster(tmp / "slurm")
    try:
        return run_check(cluster, tmp)
    finally:
        cluster.stop()
        if not opts.keep:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp}")


def run_check(cluster: Cluster, tmp: Path) -> int:
    head = sh(["git", "rev-parse", "HEAD"], cwd=REPO).stdout.strip()
    if sh(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO).stdout.strip():
        print("note: the working tree has uncommitted changes; the clone checks the committed HEAD")
    clone = tmp / "clone"
    sh(["git", "clone", "--quiet", "--no-checkout", str(REPO), str(clone)])
    sh(["git", "checkout", "--quiet", head], cwd=clone)
    check(not (clone / "logs").exists(), f"fresh clone of {head[:12]} has no logs/ folder to write into")
    data = tmp / "data"
    data.mkdir()
    out = tmp / "out"
    job = write_job(data, out)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "BATCHRUN_LLM_FACTORY")}
    env.update(PYTHONPATH=f"{clone}:{clone / 'tests'}", BATCHRUN=f"{sys.executable} -m batchrun.cli",
               BATCHRUN_CACHE=str(tmp / "cache"), BATCHRUN_PROGRESS_INTERVAL="2")
    ref = sh([sys.executable, "-m", "batchrun.cli", "run", str(job), "--set", f"output.path={tmp / 'ref'}", "-q"],
             env=env, cwd=clone)
    check(ref.returncode == 0, "the uninterrupted run without Slurm (the reference)")
    cluster.start()
    check(True, f"slurmctld and slurmd up ({sh(['sinfo', '-h', '-o', '%N %c CPUs %T'], env=cluster.env).stdout.strip()})")

    paced = {**env, "BATCHRUN_LLM_FACTORY": "test_job_fakes:PacedLLM", "BATCHRUN_FAKE_DELAY": "0.4",
             "BATCHRUN_TEST_ENGINE": "real"}
    array = ["--array=0-2", "--cpus-per-task=1", "jobs/slurm_array.sh", str(job)]
    first = cluster.sbatch(clone, paced, *array)
    check(bool(first), f"sbatch accepted the shipped script on a CPU-only node (job {first})")
    shards = [out / f"shard-{i}-of-{TASKS}" for i in range(TASKS)]
    signals = {0: ["scancel", "--signal=TERM", "--batch"], 1: ["scancel", "-s", "KILL", "--batch"]}
    sent: dict[int, float] = {}
    deadline = time.monotonic() + 600
    while len(sent) < len(signals):
        for i, cmd in signals.items():
            if i not in sent and len(rows_on_disk(shards[i])) >= 3:
                sh([*cmd, f"{first}_{i}"], env=cluster.env)
                sent[i] = time.monotonic()
        if time.monotonic() > deadline:
            raise SystemExit("slurm_check: the tasks finished no rows in time")
        time.sleep(0.2)
    cluster.wait_done(first)
    kept = {i: rows_on_disk(shards[i]) for i in signals}
    states = {i: cluster.task(first, i) for i in range(TASKS)}
    check(states[0].get("ExitCode") == "143:0", f"task 0 after SIGTERM: {states[0].get('JobState')}, exit code "
                                                f"{states[0].get('ExitCode')} (143: SIGTERM, committed first)")
    check(states[1].get("ExitCode", "").endswith(":9"), f"task 1 after SIGKILL: {states[1].get('JobState')}, "
                                                        f"exit code {states[1].get('ExitCode')} (killed by signal 9)")
    check(states[2].get("ExitCode") == "0:0", f"task 2 ran through: {states[2].get('JobState')}, "
                                              f"exit code {states[2].get('ExitCode')}")
    for i in signals:
        check(0 not in kept[i] and len(kept[i]) >= 3, f"task {i} left {len(kept[i])} of {PER_TASK} rows on disk, "
                                                        "finished behind its slow first row (kept aside)")
    logs = {i: clone / f"batchrun-{first}_{i}.out" for i in range(TASKS)}
    check(all(p.exists() for p in logs.values()), "each task's log is in the submit folder (no folder to create)")
    log0 = logs[0].read_text() if logs[0].exists() else ""
    check("interrupted by SIGTERM" in log0, "task 0's log: " + next(
        (line.split("error: ")[-1] for line in log0.splitlines() if "interrupted" in line), "no interruption line"))
    threads = re.search(r"CPU threads: (\d+) \(([^)]*)\)", log0)
    check(threads is not None and threads.group(1) == "1" and "SLURM_CPUS_PER_TASK=1" in threads.group(2),
          f"threads follow --cpus-per-task=1: {threads.group(0) if threads else 'no threads line'}")

    second = cluster.sbatch(clone, paced, *array)
    cluster.wait_done(second)
    states = {i: cluster.task(second, i) for i in range(TASKS)}
    check(all(s.get("ExitCode") == "0:0" for s in states.values()),
          f"resubmitted array {second}: exit codes {[s.get('ExitCode') for s in states.values()]}")
    log2 = (clone / f"batchrun-{second}_2.out").read_text()
    check("already complete" in log2, "the complete task was skipped on resubmission")
    for i in signals:
        this_run = json.loads((shards[i] / "_metrics.json").read_text())["this_run"]["input_rows"]
        check(this_run == PER_TASK - len(kept[i]), f"task {i}'s rerun computed {this_run} rows: the "
                                                   f"{PER_TASK - len(kept[i])} it had not finished, none again")
    merged = sh([sys.executable, "-m", "batchrun.cli", "merge", str(out)], env=env, cwd=clone, check=False)
    check(merged.returncode == 0, merged.stdout.strip() or merged.stderr.strip())
    rows, want = read(tmp / "out-merged"), read(tmp / "ref")
    check([r["id"] for r in rows] == [f"r{i:02d}" for i in range(ROWS)], f"{len(rows)} rows, every id once, in "
                                                                         "input order")
    check(rows == want, "the merged rows equal the uninterrupted run's, every column")
    verified = sh([sys.executable, "-m", "batchrun.cli", "verify", str(tmp / "out-merged")], env=env, cwd=clone,
                  check=False)
    check(verified.returncode == 0, (verified.stdout + verified.stderr).strip().splitlines()[-1])
    failed = [what for ok, what in results if not ok]
    print(f"slurm_check: {len(results) - len(failed)} of {len(results)} checks hold"
          + (f"; failed: {'; '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
