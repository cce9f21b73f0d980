#!/usr/bin/env bash
# The GPU check, in one command, for a machine with an NVIDIA GPU and no network (under 8 minutes on an
# H100/H200):
#   1. install this working tree's four distributions without fetching anything (the machine's Python must
#      already hold numpy, onnx, ml_dtypes, pluggy, cuda-bindings, and optionally torch);
#   2. print a benchmark table against torch on the same GPU (scripts/gpu_bench.py); it runs first, so its
#      kernels compile within its own time limit and the tests then find them in the NVRTC disk cache;
#   3. run tests/cuda against the real driver (ONNX_RUNTIME_CUDA_TESTS=real).
# Every phase has a time limit (together 470 s; override with INSTALL_LIMIT, BENCH_LIMIT, TEST_LIMIT), so the
# script always finishes and says what it did. Logs go to $OUT when
# that is set (the device tool's output folder), else to /tmp/gpu_check. Usage: scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"
START=$(date +%s)
INSTALL_LIMIT=${INSTALL_LIMIT:-60}
TEST_LIMIT=${TEST_LIMIT:-220}
BENCH_LIMIT=${BENCH_LIMIT:-130}
export PYTHONUNBUFFERED=1

phase() { printf '\n== %s  [t=%ss]\n' "$*" "$(( $(date +%s) - START ))"; }
limited() { timeout -k 10 "$@"; }  # timeout, then SIGKILL 10 s later if the command ignores SIGTERM

phase "machine"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null \
    || echo "nvidia-smi is not available (the tests will say whether the driver is)"
limited 30 "$PY" - <<'EOF'
import importlib
import sys

print("python", sys.version.split()[0], "at", sys.executable)
for name in ("numpy", "onnx", "ml_dtypes", "pluggy", "cuda.bindings", "pytest", "torch", "onnxruntime"):
    try:
        module = importlib.import_module(name)
        print(f"  {name:14} {getattr(module, '__version__', 'present')}")
    except Exception as exc:  # report, do not stop: the phases below say what they cannot do
        print(f"  {name:14} MISSING ({type(exc).__name__}: {exc})")
EOF

phase "install the working tree (no network, no dependencies)"
limited "$INSTALL_LIMIT" "$PY" -m pip install -q --no-deps --no-build-isolation --no-index \
    -e . -e providers/cpu -e providers/cuda -e tests/sample_provider >"$LOGS/install.log" 2>&1
install_status=$?
if [ "$install_status" -eq 0 ]; then
    echo "installed (editable): onnx-runtime, onnx-runtime-ep-cpu, onnx-runtime-ep-cuda, the sample provider"
else
    tail -n 15 "$LOGS/install.log"
    echo "pip install failed (exit $install_status); using the sources through PYTHONPATH instead" \
         "(the benchmark registers the providers in-process; session tests may fail)"
    export PYTHONPATH="$PWD/core:$PWD/providers/cpu:$PWD/providers/cuda:$PWD/tests/sample_provider${PYTHONPATH:+:$PYTHONPATH}"
fi
limited 30 "$PY" -c "
import onnx_runtime, onnx_runtime_ep_cuda
from onnx_runtime_ep_cuda import driver
print('onnx_runtime from', onnx_runtime.__file__)
print('onnx_runtime_ep_cuda from', onnx_runtime_ep_cuda.__file__)
print('CUDA driver:', driver.probe() or 'usable')
print('providers:', onnx_runtime.get_available_providers())
"

phase "benchmark against torch (limit ${BENCH_LIMIT}s)"
limited "$BENCH_LIMIT" "$PY" scripts/gpu_bench.py --watchdog "$(( BENCH_LIMIT - 15 ))" 2>&1 | tee "$LOGS/bench.log"
bench_status=${PIPESTATUS[0]}

phase "tests/cuda on the real driver (limit ${TEST_LIMIT}s, ${TEST_LIMIT_EACH:-120}s per test)"
export ONNX_RUNTIME_CUDA_TESTS=real
unset ONNX_RUNTIME_CUDA_SIM
per_test=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    per_test=(-p timeout "--timeout=${TEST_LIMIT_EACH:-120}")
fi
# Device memory, graphs, validation and decode first, then what has not run on a GPU yet (capture of whole
# models, attention, GEMM, convolution, the light CNNs, data movement), then the rest (the elementwise,
# reduction and normalization families passed on an H200 before); the simulator's own tests
# (test_simulator.py) say nothing about the GPU and are skipped. One line per test goes to the log, so a
# run stopped at the limit still shows how far it got.
limited "$TEST_LIMIT" "$PY" -m pytest -v -p no:cacheprovider -rfE ${per_test[@]+"${per_test[@]}"} \
    --ignore=tests/cuda/test_simulator.py tests/cuda/test_device_memory.py tests/cuda/test_device_graphs.py \
    tests/cuda/test_validation.py tests/cuda/test_decode.py tests/cuda/test_capture_models.py \
    tests/cuda/test_ops_attention.py tests/cuda/test_ops_linalg.py tests/cuda/test_ops_conv.py \
    tests/cuda/test_light_models_cuda.py tests/cuda/test_ops_channel_norm.py tests/cuda/test_ops_data.py \
    tests/cuda >"$LOGS/tests.log" 2>&1
test_status=$?
grep -E "^(FAILED|ERROR) " "$LOGS/tests.log" | head -n 60
for outcome in PASSED FAILED ERROR SKIPPED; do
    printf '%s %s  ' "$(grep -c " $outcome" "$LOGS/tests.log")" "$outcome"
done
echo
if [ "$test_status" -eq 124 ] || [ "$test_status" -eq 137 ]; then
    echo "tests/cuda did not finish within ${TEST_LIMIT}s and was stopped; failures so far:"
    grep -E " (FAILED|ERROR)" "$LOGS/tests.log" | head -n 40
else
    tail -n 1 "$LOGS/tests.log"
fi

phase "summary"
echo "install:   $([ "$install_status" -eq 0 ] && echo ok || echo "failed ($install_status), ran from sources")"
echo "tests:     exit $test_status (log $LOGS/tests.log)"
echo "benchmark: exit $bench_status (log $LOGS/bench.log)"
sed -n '/^benchmark  /,$p' "$LOGS/bench.log"
echo "took $(( $(date +%s) - START ))s"
[ "$test_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
