"""Scale-out: the Ray executor (Ray Data) for clusters, `batchrun merge` for job arrays' shard folders. Ray is an
optional extra that nothing here imports at module level: batchrun.plan.check_ray refuses `kind: ray` without it."""
