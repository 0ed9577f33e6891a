#!/bin/bash
# A Slurm job array over one batchrun job: task I of N processes the I-th slice of the input into
# OUTPUT/shard-I-of-N/. Submit from the repository root:   sbatch jobs/slurm_array.sh jobs/example.yaml
#
# Robust to preemption and time limits: Slurm sends SIGTERM first (here 120 s before the limit, see
# --signal); batchrun commits every finished row and exits 143. Resubmitting the same array resumes the
# unfinished shards after their last committed row and skips the shards that have _SUCCESS.
#
#SBATCH --job-name=batchrun
#SBATCH --array=0-7
#SBATCH --gres=gpu:1
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH --time=04:00:00
#SBATCH --signal=B:TERM@120
#SBATCH --output=logs/%x-%A_%a.out

set -euo pipefail
JOB=${1:-jobs/example.yaml}
shift || true

# One line per few seconds goes to the log (no progress bar off a terminal); BATCHRUN_PROGRESS_INTERVAL
# sets how often.
export BATCHRUN_PROGRESS_INTERVAL=${BATCHRUN_PROGRESS_INTERVAL:-30}

# exec: batchrun becomes the batch step's main process, so it receives the SIGTERM itself.
exec .venv/bin/batchrun run "$JOB" --shard auto "$@"

# When every task has _SUCCESS, one folder in input order (refuses while a shard is missing or incomplete):
#   .venv/bin/batchrun merge out/example                  # -> out/example-merged/
# or as a step that waits for the array:
#   sbatch --dependency=afterok:$ARRAY_JOB_ID --wrap ".venv/bin/batchrun merge out/example"
# Reading the shards directly also gives input order (shard folders sort by index):
#   python -c "import pyarrow.parquet as pq; print(pq.read_table('out/example').num_rows)"
