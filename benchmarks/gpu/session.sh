#!/usr/bin/env bash
# What a session lent a GPU runs, as one device call:
# versions, the tests that take the CUDA path, then benchmarks.gpu.check without its own test part.
# Logs and gpu_check's JSON go under $OUT (the device tool brings that folder back).
#
#     bash benchmarks/gpu/session.sh            # on the GPU machine, from the repository root
#
# It runs under the machine's own python3 and packages (torch, triton, transformers there), not our pins:
# that is what a GPU user with their own stack has. pytest-xdist spreads the tests over 16 processes so that
# Triton's compiles (one per kernel specialisation, on a fresh machine with no cache) overlap.
set -u
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1

{
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
  $PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__,
'transformers', transformers.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  nproc
} 2>&1 | tee "$OUT/versions.txt"

start=$(date +%s)
# -v: a test's result is in the log as it ends, so a run stopped by the timeout (SIGINT: pytest still prints its
# summary) says what passed. The files are those whose tests take the CUDA path, or took it by mistake before.
timeout -s INT -k 15 "${TEST_TIMEOUT:-210}" $PY -m pytest -v -p no:cacheprovider -n 16 --timeout 150 -rfE \
  tests/test_cuda.py tests/test_kernels.py tests/test_quant_matmul.py tests/test_batch_invariance_triton.py \
  tests/test_moe.py tests/test_prefix_sharing.py tests/test_batch_invariance.py tests/test_kv_quant.py \
  tests/test_sampling_kernels.py tests/test_quant_accuracy.py tests/test_families.py tests/test_parity.py \
  2>&1 | grep -v -e PytestBenchmarkWarning -e "warner(" | tee "$OUT/pytest.log"
echo "tests: $(( $(date +%s) - start ))s" | tee -a "$OUT/pytest.log"

start=$(date +%s)
# the tile sweep (part 5) only with SWEEP=1: it tunes the MMA kernel's tiles, and part 4 (every product at 9 row
# counts) already says which product each row count takes
# end to end: the 8-bit KV caches and the int4 rule beside the baseline and one peer; the eager, int8-weight and
# static-batch runs only when E2E_RUNS names them
timeout "${CHECK_TIMEOUT:-330}" $PY -m benchmarks.gpu.check --skip tests $([ "${SWEEP:-0}" = 1 ] || echo --skip sweep) \
  --e2e-runs "${E2E_RUNS:-graphs,int4,hf-cb,kv-int8,kv-fp8}" \
  --time-budget "${E2E_BUDGET:-170}" --json-out "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log"
echo "gpu_check: $(( $(date +%s) - start ))s" | tee -a "$OUT/gpu_check.log"
