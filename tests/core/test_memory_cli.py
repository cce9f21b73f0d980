"""``onnx-runtime info MODEL --memory`` and the memory options of ``info``, ``run`` and ``bench``."""

from __future__ import annotations

import gc

import pytest
from chain_models import external_chain
from onnx_runtime.cli import main
from onnx_runtime.memory import process_governor, set_device_memory_limit

SAMPLE = "SampleDeviceExecutionProvider,CPUExecutionProvider"
D = 2048


@pytest.fixture
def chain(tmp_path):
    path = external_chain(tmp_path / "chain.onnx", D, layers=6, location="chain.data")
    yield path
    gc.collect()
    set_device_memory_limit("other:7", None)


def test_info_memory_reports_weights_budgets_residency_and_sites(chain, capsys):
    assert main(["info", chain, "--providers", SAMPLE, "--memory", "--weight-budget", str(2 * D * 4),
                 "--memory-limit", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "host: 6 weights, 48.0 KiB (48.0 KiB mapped from external data" in out
    assert "device other:7: limit 1.0 MiB" in out
    assert "weights: 6, 48.0 KiB, paged under a 16.0 KiB budget; reserved 16.0 KiB" in out
    assert "evictions" in out and "peak activations and workspace of the run:" in out
    assert "allocation site " in out and "requests" in out


def test_info_memory_on_the_host_says_there_is_no_device_budget(chain, capsys):
    assert main(["info", chain, "--providers", "CPUExecutionProvider", "--memory"]) == 0
    out = capsys.readouterr().out
    assert "host: 6 weights" in out and "no device provider runs a node" in out


def test_a_limit_the_model_does_not_fit_is_reported_by_run(chain, capsys):
    assert main(["run", chain, "--providers", SAMPLE, "--memory-limit", "1000", "--repeat", "1"]) == 2
    err = capsys.readouterr().err
    assert "error:" in err and "weights on SampleDeviceExecutionProvider" in err and "short" in err


def test_bench_takes_the_memory_options(chain, capsys):
    assert main(["bench", chain, "--providers", SAMPLE, "--weight-budget", str(2 * D * 4), "--repeat", "2",
                 "--warmup", "0"]) == 0
    gc.collect()
    assert process_governor().limit("other:7") is None
