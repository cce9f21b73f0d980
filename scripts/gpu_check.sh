#!/usr/bin/env bash
# The GPU check, in one command, for a bare machine with an NVIDIA GPU and no network:
#   0. prerequisites, all checked up front (scripts/gpu_prereqs.py): Python >= 3.10; numpy, onnx, ml_dtypes,
#      pluggy, pytest; cuda-python 13; the NVRTC 13 wheel (nvidia-cuda-nvrtc); the CUDA headers wheel
#      (nvidia-cuda-runtime: cuda_fp16.h, cuda_bf16.h); an NVIDIA driver >= 580 (CUDA 13) with a visible GPU
#      of compute capability >= 7.0; optionally torch with CUDA (the benchmark's torch columns), transformers
#      and benchmarks/.models/zoo (the generate rows: tokens/s vs torch), onnxruntime, pytest-timeout. A missing required one stops the check with the command that fixes it;
#   1. install this working tree's four distributions without fetching anything (--no-deps --no-index);
#   2. the tests that matter first: tests/cuda against the real driver (ONNX_RUNTIME_CUDA_TESTS=real), device
#      memory, faults, threads, graphs, validation and decode first, the simulator's own tests left out; in
#      TEST_WORKERS processes where pytest-xdist is installed (default half the CPUs, at most 8);
#   3. the benchmark table against torch on the same GPU (scripts/gpu_bench.py), the generate loop's tokens/s
#      against torch's greedy loop on the zoo's decoders included (scripts/gpu_generate.py).
# Every phase has a time limit (INSTALL_LIMIT, TEST_LIMIT, BENCH_LIMIT; together under 8 minutes), so the
# script always finishes and says what it did. Logs go to $OUT when that is set (the device tool's output
# folder), else to /tmp/gpu_check.
#
# usage: scripts/gpu_check.sh [--dry-run] [--prereqs-only]
#   --dry-run       no GPU needed: the CUDA simulator stands in for the driver (ONNX_RUNTIME_CUDA_SIM=1), the
#                   GPU-only prerequisites are reported but not required, nothing is installed, the tests
#                   run a short simulator selection and the benchmark runs with --small. It checks the
#                   script itself, not the GPU.
#   --prereqs-only  stop after the prerequisites (exit 1 when one is missing).
set -uo pipefail
cd "$(dirname "$0")/.."

DRY=0
PREREQS_ONLY=0
for arg in "$@"; do
    case "$arg" in
        --dry-run) DRY=1 ;;
        --prereqs-only) PREREQS_ONLY=1 ;;
        -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument '$arg' (use --dry-run, --prereqs-only or --help)" >&2; exit 2 ;;
    esac
done

PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/gpu_check}
mkdir -p "$LOGS"
START=$(date +%s)
INSTALL_LIMIT=${INSTALL_LIMIT:-60}
TEST_LIMIT=${TEST_LIMIT:-260}
BENCH_LIMIT=${BENCH_LIMIT:-130}
export PYTHONUNBUFFERED=1

phase() { printf '\n== %s  [t=%ss]\n' "$*" "$(( $(date +%s) - START ))"; }
limited() { timeout -k 10 "$@"; }  # timeout, then SIGKILL 10 s later if the command ignores SIGTERM

if ! command -v "$PY" >/dev/null 2>&1; then
    echo "gpu_check.sh: '$PY' not found; install Python >= 3.10 or set PYTHON to one" >&2
    exit 1
fi

phase "prerequisites"
if [ "$DRY" -eq 1 ]; then
    export ONNX_RUNTIME_CUDA_SIM=1
    unset ONNX_RUNTIME_CUDA_TESTS
    prereq_args=(--simulator)
else
    unset ONNX_RUNTIME_CUDA_SIM
    prereq_args=()
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || true
fi
# The checker imports the provider; before the install, the sources stand in for it.
PYTHONPATH="$PWD/core:$PWD/providers/cpu:$PWD/providers/cuda${PYTHONPATH:+:$PYTHONPATH}" \
    limited 60 "$PY" scripts/gpu_prereqs.py ${prereq_args[@]+"${prereq_args[@]}"} 2>&1 | tee "$LOGS/prereqs.log"
prereq_status=${PIPESTATUS[0]}
if [ "$prereq_status" -ne 0 ]; then
    echo "gpu_check.sh: prerequisites not met (exit $prereq_status); fix the lines marked MISSING and run again"
    exit 1
fi
[ "$PREREQS_ONLY" -eq 1 ] && exit 0

phase "install the working tree (no network, no dependencies)"
install_status=0
if [ "$DRY" -eq 1 ]; then
    echo "dry run: not installed; the sources run through PYTHONPATH"
    export PYTHONPATH="$PWD/core:$PWD/providers/cpu:$PWD/providers/cuda:$PWD/tests/sample_provider${PYTHONPATH:+:$PYTHONPATH}"
else
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
fi
limited 30 "$PY" -c "
import onnx_runtime, onnx_runtime_ep_cuda
from onnx_runtime_ep_cuda import driver
print('onnx_runtime from', onnx_runtime.__file__)
print('CUDA driver:', driver.probe() or ('usable (simulated)' if driver.simulated() else 'usable'))
print('providers:', onnx_runtime.get_available_providers())
"

if [ "$DRY" -eq 1 ]; then
    phase "tests/cuda on the CUDA simulator: a short selection (limit ${TEST_LIMIT}s)"
    unset ONNX_RUNTIME_CUDA_TESTS
    tests=(tests/cuda/test_device_faults.py tests/cuda/test_concurrency.py tests/cuda/test_simulator_modes.py
           tests/cuda/test_streams_per_session_cuda.py tests/cuda/test_streams_lent_memory_cuda.py
           tests/cuda/test_streams_session_sync_cuda.py tests/cuda/test_device_graph_recapture_cuda.py
           tests/cuda/test_device_binding_queued_cuda.py)
else
    phase "tests/cuda on the real driver (limit ${TEST_LIMIT}s, ${TEST_LIMIT_EACH:-60}s per test)"
    export ONNX_RUNTIME_CUDA_TESTS=real
    # What a GPU can break that the simulator cannot show first: device memory, faults, threads, graphs,
    # validation and decode; then what has not run on a GPU yet (capture of whole models, attention, GEMM,
    # convolution, the light CNNs, data movement); then the rest. The simulator's own tests say nothing
    # about the GPU. One line per test goes to the log, so a run stopped at the limit shows how far it got.
    tests=(--ignore=tests/cuda/test_simulator.py --ignore=tests/cuda/test_simulator_modes.py
           tests/cuda/test_device_memory.py tests/cuda/test_device_faults.py tests/cuda/test_concurrency.py
           tests/cuda/test_streams_per_session_cuda.py tests/cuda/test_streams_lent_memory_cuda.py
           tests/cuda/test_streams_session_sync_cuda.py tests/cuda/test_device_graph_recapture_cuda.py tests/cuda/test_device_binding_queued_cuda.py
           tests/cuda/test_streams_cross_free_cuda.py tests/cuda/test_device_graphs.py tests/cuda/test_validation.py tests/cuda/test_decode.py
           tests/cuda/test_decode_step_counter_cuda.py tests/cuda/test_validation_in_graph_cuda.py tests/cuda/test_capture_models.py tests/cuda/test_ops_attention.py tests/cuda/test_ops_linalg.py
           tests/cuda/test_ops_conv.py tests/cuda/test_light_models_cuda.py tests/cuda/test_ops_channel_norm.py
           tests/cuda/test_ops_data.py tests/cuda)
fi
per_test=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    # The thread method dumps every thread's stack into the log and ends the process, so a test stuck inside a
    # driver call (where the signal method cannot interrupt it) is reported and xdist goes on in a new worker.
    per_test=(-p timeout "--timeout=${TEST_LIMIT_EACH:-60}" --timeout-method=thread)
fi
# On a GPU machine the 2,000 tests of tests/cuda do not fit the limit one at a time: with pytest-xdist they run in
# TEST_WORKERS processes (default: half the CPUs, at most 8), each with its own CUDA context. TEST_WORKERS=1 keeps
# the order above. The dry run stays in one process.
workers=${TEST_WORKERS:-$(( $(nproc) / 2 > 8 ? 8 : $(nproc) / 2 ))}
if [ "$DRY" -eq 0 ] && [ "$workers" -gt 1 ] && "$PY" -c "import xdist" 2>/dev/null; then
    per_test+=(-n "$workers")
    echo "tests in $workers processes (pytest-xdist)"
fi
limited "$TEST_LIMIT" "$PY" -m pytest -v -p no:cacheprovider -rfE ${per_test[@]+"${per_test[@]}"} "${tests[@]}" \
    >"$LOGS/tests.log" 2>&1
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

phase "benchmark against torch (limit ${BENCH_LIMIT}s)"
bench_args=(--watchdog "$(( BENCH_LIMIT - 15 ))")
[ "$DRY" -eq 1 ] && bench_args+=(--small)
limited "$BENCH_LIMIT" "$PY" scripts/gpu_bench.py "${bench_args[@]}" 2>&1 | tee "$LOGS/bench.log"
bench_status=${PIPESTATUS[0]}

phase "summary"
[ "$DRY" -eq 1 ] && echo "DRY RUN on the CUDA simulator: the timings are meaningless, the GPU was not checked"
echo "install:   $([ "$install_status" -eq 0 ] && echo ok || echo "failed ($install_status), ran from sources")"
echo "tests:     exit $test_status (log $LOGS/tests.log)"
echo "benchmark: exit $bench_status (log $LOGS/bench.log)"
sed -n '/^benchmark  /,$p' "$LOGS/bench.log"
echo "took $(( $(date +%s) - START ))s"
[ "$test_status" -eq 0 ] && [ "$bench_status" -eq 0 ]
