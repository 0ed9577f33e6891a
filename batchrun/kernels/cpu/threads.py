"""How many CPU threads the engine runs: the least of the affinity mask, the cgroup CPU quota (rounded down) and
SLURM_CPUS_PER_TASK, unless engine.num_threads or OMP_NUM_THREADS says. It sizes torch's pool, the C kernels' too."""

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
    """CPUs per period the process's cgroups allow (v2 cpu.max, v1 cfs quota / period); None: unlimited."""
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
    """The quotas from the process's cgroup folder up to the root (in a container that folder may be missing)."""
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
    env = os.environ if env is None else env
    if num_threads is not None:
        return num_threads, "engine.num_threads"
    omp = env.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    n, why = allowed_cpus(env)
    return n, why


def configure_threads(num_threads: int | None) -> int:
    """Size torch's thread pool (the C kernels' too); returns the count."""
    import torch

    n, why = thread_count(num_threads)
    torch.set_num_threads(n)
    log.info("CPU threads: %d (%s)", n, why)
    return n
