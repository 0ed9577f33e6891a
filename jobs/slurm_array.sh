#!/bin/bash
# A Slurm job array over one batchrun job: task I of N processes the I-th slice of the input into
# OUTPUT/shard-I-of-N/. Submit from the repository root of a clone set up with `make setup`:
#
#   CPU nodes:  sbatch jobs/slurm_array.sh jobs/example.yaml
#   GPU nodes:  sbatch --gres=gpu:1 --cpus-per-task=8 --mem=32G jobs/slurm_array.sh jobs/example.yaml
#
# Options on the sbatch line override the #SBATCH lines below: --array=0-3 for 4 tasks, --time, --partition,
# --account, --output. Nothing here asks for a GPU, so the script runs as it is on a CPU-only cluster; the
# GPU line adds one per task (docs/cluster.md). The log of task I is batchrun-<array job id>_<I>.out in the
# folder sbatch was run from (Slurm opens it before the script starts, so it must be a folder that exists).
#
# Resources: --cpus-per-task is what batchrun's threads use (it reads SLURM_CPUS_PER_TASK, the affinity mask
# and the cgroup quota, and logs the count at start). --mem must hold the weights (4 bytes per parameter in
# float32, 2 in bfloat16), the KV cache (engine.kv_cache_memory: 2 GiB by default on a CPU; on a GPU it lives
# in GPU memory) and about 2 GiB of runtime: 8G fits models up to about 1B parameters in float32.
#
# Robust to preemption and time limits: Slurm sends SIGTERM first (here 120 s before the limit, see --signal);
# batchrun commits every finished row (those finished out of input order kept aside) and exits 143. Resubmitting
# the same array resumes the unfinished shards, computing only rows that had not finished, and skips the shards
# that have _SUCCESS (docs/durability.md says exactly what each kind of stop keeps). Two tasks of the same shard never write at once: the second exits 2 naming the first.
#
#SBATCH --job-name=batchrun
#SBATCH --array=0-7
#SBATCH --cpus-per-task=4
#SBATCH --mem=8G
#SBATCH --time=04:00:00
#SBATCH --signal=B:TERM@120
#SBATCH --output=batchrun-%A_%a.out

set -euo pipefail
JOB=${1:-jobs/example.yaml}
shift || true

# Which batchrun: $BATCHRUN when set (e.g. "python -m batchrun.cli" of another environment), else the clone's
# .venv (make setup), else the one on PATH.
if [ -z "${BATCHRUN:-}" ]; then
    if [ -x .venv/bin/batchrun ]; then BATCHRUN=.venv/bin/batchrun
    elif command -v batchrun >/dev/null; then BATCHRUN=batchrun
    else echo "slurm_array.sh: no batchrun: run make setup in $(pwd), or set BATCHRUN" >&2; exit 2
    fi
fi

# One line per few seconds goes to the log (no progress bar off a terminal); BATCHRUN_PROGRESS_INTERVAL
# sets how often.
export BATCHRUN_PROGRESS_INTERVAL=${BATCHRUN_PROGRESS_INTERVAL:-30}

# exec: batchrun becomes the batch step's main process, so it receives the SIGTERM itself.
# shellcheck disable=SC2086  # BATCHRUN may be a command with arguments
exec $BATCHRUN run "$JOB" --shard auto "$@"

# When every task has _SUCCESS, one folder in input order (refuses while a shard is missing, incomplete or
# still running):
#   .venv/bin/batchrun merge out/example                  # -> out/example-merged/
# or as a step that waits for the array:
#   sbatch --dependency=afterok:$ARRAY_JOB_ID --wrap ".venv/bin/batchrun merge out/example"
# Reading the shards directly also gives input order (shard folders sort by index):
#   python -c "import pyarrow.parquet as pq; print(pq.read_table('out/example').num_rows)"
