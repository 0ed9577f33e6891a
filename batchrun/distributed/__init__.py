"""Scale-out on existing distributed engines: Ray Data for clusters, shard folders for job arrays.

Ray is an optional extra: nothing here imports it at module level, so `kind: ray` without Ray installed is
refused at plan time (batchrun.plan.check_ray: exit 2, before any model is loaded) with the line that installs it.
"""
