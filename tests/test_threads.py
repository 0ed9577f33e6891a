"""Threads follow what the process may use: the affinity mask (taskset), a cgroup CPU quota (v2 cpu.max, v1
cfs_quota_us, read from a fake cgroup tree), SLURM_CPUS_PER_TASK; engine.num_threads overrides; the engine
sets torch's pool (the OpenMP pool the C kernels run on) and logs the count."""

import os
import shutil
import subprocess
import sys

import pytest
from test_job_fakes import REPO

from batchrun.kernels.cpu.threads import allowed_cpus, cgroup_cpu_quota, thread_count

ALL = len(os.sched_getaffinity(0))


def v2_tree(tmp_path, limits):
    """A cgroup v2 tree: limits maps a folder under the root to its cpu.max line."""
    root = tmp_path / "cgroup"
    for folder, line in limits.items():
        (root / folder).mkdir(parents=True, exist_ok=True)
        (root / folder / "cpu.max").write_text(line + "\n")
    leaf = max(limits, key=len)
    proc = tmp_path / "proc_cgroup"
    proc.write_text(f"0::/{leaf}\n")
    return root, proc


def test_cgroup_v2_quota_of_the_tightest_ancestor(tmp_path):
    root, proc = v2_tree(tmp_path, {"kubepods": "max 100000", "kubepods/pod1": "250000 100000",
                                    "kubepods/pod1/ctr": "max 100000"})
    assert cgroup_cpu_quota(root, proc) == 2.5
    threads, why = allowed_cpus({}, root, proc)
    assert threads == min(2, ALL) and "the cgroup CPU quota is 2.5" in why


def test_cgroup_v2_fraction_gives_one_thread_and_no_limit_gives_none(tmp_path):
    root, proc = v2_tree(tmp_path, {"job": "50000 100000"})
    assert allowed_cpus({}, root, proc)[0] == 1
    root, proc = v2_tree(tmp_path / "b", {"job": "max 100000"})
    assert cgroup_cpu_quota(root, proc) is None and allowed_cpus({}, root, proc)[0] == ALL


def test_cgroup_v2_inside_a_container(tmp_path):
    """A cgroup namespace shows the container's own cgroup as the root: /proc/self/cgroup says 0::/."""
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cpu.max").write_text("100000 100000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("0::/\n")
    assert cgroup_cpu_quota(root, proc) == 1.0


def test_cgroup_v1_cfs_quota(tmp_path):
    root = tmp_path / "cgroup"
    job = root / "cpu,cpuacct" / "slurm" / "uid_0" / "job_7"
    job.mkdir(parents=True)
    (job / "cpu.cfs_quota_us").write_text("300000\n")
    (job / "cpu.cfs_period_us").write_text("100000\n")
    (job.parent / "cpu.cfs_quota_us").write_text("-1\n")
    (job.parent / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc_cgroup"
    proc.write_text("12:memory:/slurm/uid_0/job_7\n4:cpu,cpuacct:/slurm/uid_0/job_7\n0::/\n")
    assert cgroup_cpu_quota(root, proc) == 3.0


def test_slurm_cpus_per_task_and_the_overrides(tmp_path):
    empty = tmp_path / "none"
    empty.mkdir()
    no_proc = tmp_path / "missing"
    assert allowed_cpus({"SLURM_CPUS_PER_TASK": "1"}, empty, no_proc) == (
        1, f"the affinity mask allows {ALL}; SLURM_CPUS_PER_TASK=1")
    assert thread_count(3, {"SLURM_CPUS_PER_TASK": "1", "OMP_NUM_THREADS": "2"}) == (3, "engine.num_threads")
    assert thread_count(None, {"SLURM_CPUS_PER_TASK": "1", "OMP_NUM_THREADS": "2"}) == (2, "OMP_NUM_THREADS")


def _child_env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "SLURM_CPUS_PER_TASK")}
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, **extra}


@pytest.mark.skipif(shutil.which("taskset") is None, reason="needs taskset (util-linux)")
def test_taskset_limits_the_engine_threads():
    """A real engine under `taskset -c 0` runs one thread, and says so; num_threads overrides the mask."""
    code = ("import logging, torch; logging.basicConfig(level=logging.INFO);"
            "from batchrun import LLM;"
            "llm = LLM('builtin:tiny-llama', kv_cache_memory='8MiB', num_threads={n});"
            "print('threads', torch.get_num_threads())")
    one = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code.format(n=None)], env=_child_env(),
                         capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-2000:]
    assert "threads 1" in one.stdout
    assert "CPU threads: 1 (the affinity mask allows 1" in one.stderr
    forced = subprocess.run(["taskset", "-c", "0", sys.executable, "-c", code.format(n=2)], env=_child_env(),
                            capture_output=True, text=True, timeout=300)
    assert forced.returncode == 0 and "threads 2" in forced.stdout
    assert "CPU threads: 2 (engine.num_threads)" in forced.stderr
    slurm = subprocess.run([sys.executable, "-c", code.format(n=None)], env=_child_env(SLURM_CPUS_PER_TASK="1"),
                           capture_output=True, text=True, timeout=300)
    assert slurm.returncode == 0 and "threads 1" in slurm.stdout and "SLURM_CPUS_PER_TASK=1" in slurm.stderr


def test_a_busy_thread_of_this_process_is_not_another_process():
    """The OpenMP wait choice counts other processes' running threads: this process's own busy thread (a torch
    matmul loop, the GIL released) is seen running by _own_running, which _others_running subtracts."""
    import threading

    import torch

    import batchrun

    done = threading.Event()

    def busy() -> None:
        a = torch.randn(256, 256)
        while not done.is_set():
            a @ a

    worker = threading.Thread(target=busy)
    with torch.inference_mode():
        torch.set_num_threads(1)
        worker.start()
        try:
            own = max(batchrun._own_running() for _ in range(50))
        finally:
            done.set()
            worker.join()
    assert own >= 2  # the reading thread and the busy one, both subtracted from the runnable count
