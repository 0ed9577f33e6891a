"""`--shard auto` on each scheduler: the task index and the array size from the variables it sets (and the
count a Kubernetes Job or PBS array is given by hand), and a one-line exit 2 when something is missing."""

import pytest

from batchrun.config import JobError
from batchrun.shards import ShardSpec, from_scheduler


@pytest.mark.parametrize("env,want,source", [
    ({"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "3"}, (2, 4),
     "SLURM_ARRAY_TASK_ID"),
    ({"SLURM_ARRAY_TASK_ID": "8", "SLURM_ARRAY_TASK_COUNT": "4", "SLURM_ARRAY_TASK_MIN": "0",
      "SLURM_ARRAY_TASK_STEP": "4"}, (2, 4), "SLURM_ARRAY_TASK_ID"),  # --array=0-12:4
    ({"SGE_TASK_ID": "3", "SGE_TASK_FIRST": "1", "SGE_TASK_LAST": "10", "SGE_TASK_STEPSIZE": "1"}, (2, 10),
     "SGE_TASK_ID"),
    ({"SGE_TASK_ID": "7", "SGE_TASK_FIRST": "1", "SGE_TASK_LAST": "9", "SGE_TASK_STEPSIZE": "3"}, (2, 3),
     "SGE_TASK_ID"),  # qsub -t 1-9:3: tasks 1, 4, 7
    ({"PBS_ARRAY_INDEX": "6", "BATCHRUN_SHARD_COUNT": "8"}, (6, 8), "PBS_ARRAY_INDEX"),
    ({"PBS_ARRAYID": "0", "BATCHRUN_SHARD_COUNT": "3"}, (0, 3), "PBS_ARRAYID"),
    ({"JOB_COMPLETION_INDEX": "1", "BATCHRUN_SHARD_COUNT": "2"}, (1, 2), "JOB_COMPLETION_INDEX"),
    ({"AWS_BATCH_JOB_ARRAY_INDEX": "9", "AWS_BATCH_JOB_ARRAY_SIZE": "10"}, (9, 10), "AWS_BATCH_JOB_ARRAY_INDEX"),
    ({"AWS_BATCH_JOB_ARRAY_INDEX": "1", "BATCHRUN_SHARD_COUNT": "2"}, (1, 2), "AWS_BATCH_JOB_ARRAY_INDEX"),
    ({"BATCHRUN_SHARD_INDEX": "0", "BATCHRUN_SHARD_COUNT": "1"}, (0, 1), "BATCHRUN_SHARD_INDEX"),
    ({"SGE_TASK_ID": "undefined", "JOB_COMPLETION_INDEX": "0", "BATCHRUN_SHARD_COUNT": "1"}, (0, 1),
     "JOB_COMPLETION_INDEX"),  # SGE outside an array says "undefined"
])
def test_each_scheduler(env, want, source):
    assert from_scheduler(env) == (*want, source)
    assert ShardSpec.parse("auto", env) == ShardSpec(*want)


@pytest.mark.parametrize("env,message", [
    ({}, "not inside a job array"),
    ({"JOB_COMPLETION_INDEX": "1"}, "set BATCHRUN_SHARD_COUNT (for a Kubernetes Indexed Job, to its completions)"),
    ({"PBS_ARRAY_INDEX": "2"}, "PBS_ARRAY_INDEX is set but not the number of tasks"),
    ({"SLURM_ARRAY_TASK_ID": "1"}, "not SLURM_ARRAY_TASK_COUNT"),
    ({"SLURM_ARRAY_TASK_ID": "x", "SLURM_ARRAY_TASK_COUNT": "2"}, "SLURM_ARRAY_TASK_ID='x' is not an integer"),
    ({"PBS_ARRAY_INDEX": "8", "BATCHRUN_SHARD_COUNT": "8"}, "task index 8 of 8 tasks is not in 0..7"),
])
def test_what_is_missing_is_said(env, message):
    with pytest.raises(JobError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ShardSpec.parse("auto", env)
