#!/usr/bin/env bash
# Re-resolves constraints.txt: every package the README's commands, .ci/run, tox and scripts/build_zoo.sh
# (torch, the CPU build, with transformers and onnxscript) install, at the newest releases the index serves
# today, for this Python. Run it after changing a dependency, then run
# the tests with the new pins (.ci/run) before committing them. `tox -e latest` runs the suite unpinned.
set -euo pipefail
cd "$(dirname "$0")/.."

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
python3 -m venv "$scratch/venv"
pip="$scratch/venv/bin/python -m pip"
$pip install -q --upgrade pip setuptools
$pip install -q -e ".[cpu,cuda,test]" -e providers/cpu -e providers/cuda -e tests/sample_provider tox
$pip install -q torch==2.13.0 transformers onnxscript  # the model zoo's exporters (scripts/build_zoo.sh)
# ml_dtypes 0.7's import costs about a second of CPU, paid by every process that imports onnx (0f4f6cc): keep 0.6.
$pip install -q 'ml_dtypes<0.7'
{
  echo "# Pinned versions of everything the README's commands, .ci/run, tox and the zoo build install (resolved for"
  echo "# CPython $($scratch/venv/bin/python -c 'import sys; print(".".join(map(str, sys.version_info[:2])))')"\
       "on $(date -u +%Y-%m-%d) by scripts/refresh_constraints.sh). Used as pip -c / --build-constraint."
  $pip freeze --all --exclude-editable | grep -v "^-e " | LC_ALL=C sort -f
} > constraints.txt
echo "constraints.txt: $(grep -vc '^#' constraints.txt) packages"
