"""A session told its graph inputs are per-call data (session.graph_inputs_are_data, which the batch predictor sets)
copies a read-only graph input into its segment from the first plan: a batch worker's warm-up run on read-only
zeros makes the plan its first real batch runs, one plan per batch shape, where without the hint the first real
batch binds, sees the feed change and plans again. Every run within a float64 reference."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime import session as session_module
from onnx_runtime_ep_cpu.ops import segment as segment_module
from reference64 import run_float64
from test_batch_readonly_feeds import _cnn, watch_segments


def _planned_shapes(monkeypatch, hint: str | None, batches) -> tuple[list, list]:
    made, planned = watch_segments(monkeypatch)
    model = _cnn()
    options = session_module.SessionOptions()
    options.intra_op_num_threads = 1
    options.add_session_config_entry("session.compile_in_background", "0")
    options.add_session_config_entry("session.plan_cache", "0")
    if hint is not None:
        options.add_session_config_entry(segment_module.DATA_INPUTS_KEY, hint)
    sess = session_module.InferenceSession(model.SerializeToString(), sess_options=options)
    for x in batches:
        (got,) = sess.run(None, {"x": x})
        (exact,) = run_float64(model, {"x": x})
        assert np.abs(got - exact).max() <= 1e-4 * (1 + np.abs(exact).max()), x.shape
    return planned, made


def _worker_batches() -> list:
    """A prepared worker's runs: read-only zeros of the batch size, then a shard's micro-batches of 8 and its tail."""
    zeros = np.zeros((8, 3, 17, 17), np.float32)
    rows = np.random.default_rng(7).standard_normal((21, 3, 17, 17)).astype(np.float32)
    batches = [zeros, rows[0:8], rows[8:16], rows[16:21]]
    for x in batches:
        x.setflags(write=False)
    return batches


def test_the_hint_makes_the_warm_up_plan_the_final_one(monkeypatch):
    planned, made = _planned_shapes(monkeypatch, "1", _worker_batches())
    assert sorted(planned) == [(5, 3, 17, 17), (8, 3, 17, 17)], planned
    copies = [s for s in made if any(p for p in s.plans.values())]
    assert copies and all(s.fed == {0} for s in copies)


@pytest.mark.parametrize("hint", [None, "0"])
def test_without_the_hint_the_first_batch_plans_again(monkeypatch, hint):
    """The control: the warm-up's zeros are bound as a constant, and the first real batch plans again."""
    planned, _ = _planned_shapes(monkeypatch, hint, _worker_batches())
    assert sorted(planned) == [(5, 3, 17, 17), (8, 3, 17, 17), (8, 3, 17, 17)], planned


def test_a_weight_fed_as_a_graph_input_is_still_bound_without_the_hint(monkeypatch):
    x = np.random.default_rng(3).standard_normal((4, 3, 17, 17)).astype(np.float32)
    x.setflags(write=False)
    planned, made = _planned_shapes(monkeypatch, None, [x] * 4)
    planned_segments = [s for s in made if any(p for p in s.plans.values())]
    assert planned == [(4, 3, 17, 17)] and planned_segments and not any(s.fed for s in planned_segments)
