"""How many CPU threads the engine runs: the CPUs this process may use, not the machine's count.

A scheduler gives a task its CPUs in one of three ways, and a process sees each differently: an affinity
mask (Slurm with task/affinity or task/cgroup, `taskset`, numactl), a CFS quota in its cgroup (containers,
Kubernetes CPU limits, Slurm's cgroup plugin; the process still sees every core), or only an environment
variable (SLURM_CPUS_PER_TASK where Slurm enforces nothing, e.g. TaskPlugin=task/none). The count is the
least of the three; a quota of 1.5 CPUs gives 1 thread (a second one would be throttled). `engine.num_threads`
overrides it, as does OMP_NUM_THREADS when set. The count goes to torch's intra-op pool, which is also the
OpenMP pool the C kernels' loops run on (batchrun.kernels.cpu), and is logged once at start.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def allowed_cpus(env: Mapping[str, str] | None = None, cgroup_root: Path = CGROUP_ROOT,
                 proc_cgroup: Path = PROC_CGROUP) -> tuple[int, str]:
    """(threads, why): the least of the affinity mask, the cgroup CPU quota and SLURM_CPUS_PER_TASK."""
    env = os.environ if env is None else env
    limits: list[tuple[int, str]] = []
    try:
        mask = len(os.sched_getaffinity(0))
        limits.append((mask, f"the affinity mask allows {mask}"))
    except (AttributeError, OSError):
        limits.append((os.cpu_count() or 1, f"the machine has {os.cpu_count() or 1}"))
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        limits.append((max(1, math.floor(quota)), f"the cgroup CPU quota is {quota:g}"))
    slurm = env.get("SLURM_CPUS_PER_TASK")
    if slurm and slurm.isdigit() and int(slurm) > 0:
        limits.append((int(slurm), f"SLURM_CPUS_PER_TASK={slurm}"))
    threads, _ = min(limits)
    return threads, "; ".join(why for _, why in limits)


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """CPUs the process's cgroup (and its parents) may use per period, None when unlimited or unknown:
    cgroup v2's cpu.max ("max 100000" or "150000 100000"), v1's cpu.cfs_quota_us / cpu.cfs_period_us."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # v2: one unified hierarchy
            quotas += _walk(cgroup_root, path, _v2_quota)
        elif "cpu" in controllers.split(","):
            mount = next((cgroup_root / name for name in (controllers, "cpu,cpuacct", "cpu")
                          if (cgroup_root / name).is_dir()), None)
            if mount is not None:
                quotas += _walk(mount, path, _v1_quota)
    return min(quotas) if quotas else None


def _walk(root: Path, path: str, read) -> list[float]:
    """The quotas from the process's own cgroup folder up to the root (any of them limits it). Inside a
    container the folder named in /proc/self/cgroup may not exist: its root is then the container's own."""
    here = root / path.strip("/")
    if not here.is_dir():
        here = root
    found = []
    while True:
        q = read(here)
        if q is not None:
            found.append(q)
        if here == root or root not in here.parents:
            return found
        here = here.parent


def _v2_quota(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def thread_count(num_threads: int | None, env: Mapping[str, str] | None = None) -> tuple[int, str]:
    """engine.num_threads, else OMP_NUM_THREADS, else what the process may use."""
    env = os.environ if env is None else env
    if num_threads is not None:
        return num_threads, "engine.num_threads"
    omp = env.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    n, why = allowed_cpus(env)
    return n, why


def configure_threads(num_threads: int | None) -> int:
    """Size torch's (and so OpenMP's and the C kernels') thread pool; returns the count."""
    import torch

    n, why = thread_count(num_threads)
    torch.set_num_threads(n)
    log.info("CPU threads: %d (%s)", n, why)
    return n
