"""Scale-out on existing distributed engines: Ray Data for clusters, shard folders for job arrays.

Ray is an optional extra: nothing here imports it at module level, so `kind: ray` without Ray installed is
refused at plan time (exit 2, before any model is loaded) with the line that installs it.
"""

from __future__ import annotations

from batchrun.config import JobError

RAY_INSTALL_HINT = "pip install 'batchrun[ray]'  (or: pip install 'ray[data]>=2.50')"


def require_ray() -> None:
    """JobError (exit 2) when Ray Data cannot be imported."""
    try:
        import ray  # noqa: F401
        import ray.data  # noqa: F401
    except ImportError as e:
        raise JobError(f"executor.kind: ray needs Ray Data, which is not installed here ({e}); "
                       f"install it with: {RAY_INSTALL_HINT}") from None
