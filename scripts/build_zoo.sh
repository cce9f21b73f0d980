#!/usr/bin/env bash
# Builds the model zoo: small ONNX models exported from PyTorch with both of its exporters, and their float16,
# int8, int4 and optimizer variants (benchmarks/zoo.py), into benchmarks/.models/zoo/ (git-ignored) with its
# manifest.json; tests/cpu/test_zoo.py runs them against onnxruntime. torch and transformers stay out of the
# main venv: they go into .venv-zoo (git-ignored), at the versions pinned in constraints.txt (torch 2.13.0 is
# the CPU build). Arguments go to zoo.py, e.g. scripts/build_zoo.sh --models bert,gpt2 --exporters dynamo
set -euo pipefail
cd "$(dirname "$0")/.."

start=$SECONDS
venv=.venv-zoo
out=benchmarks/.models/zoo
[ -x "$venv/bin/python" ] || "${PYTHON:-python3}" -m venv "$venv"
"$venv/bin/python" -m pip install -q -c constraints.txt -U pip  # --build-constraint needs pip 25.3 or newer
"$venv/bin/python" -m pip install -q -c constraints.txt torch==2.13.0 transformers onnxscript onnx onnxruntime
# Libraries that need torch and drive onnxruntime (tests/cpu/test_real_libraries.py runs them in this venv with this
# runtime substituted): silero-vad without its audio extras, and this runtime with its CPU provider.
"$venv/bin/python" -m pip install -q -c constraints.txt --build-constraint constraints.txt -e . -e providers/cpu
"$venv/bin/python" -m pip install -q -c constraints.txt --no-deps silero-vad
echo "installed in $((SECONDS - start)) s: $("$venv/bin/python" -m pip freeze | grep -iE '^(torch|transformers|onnx|onnxscript|onnxruntime)==' | tr '\n' ' ')"
rm -rf "$out"
"$venv/bin/python" benchmarks/zoo.py --out "$out" "$@"
echo "zoo built in $((SECONDS - start)) s: $out ($(du -sh "$out" | cut -f1))"
