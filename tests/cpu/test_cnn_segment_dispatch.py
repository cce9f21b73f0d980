"""A segment's bound plan calls each compiled loop's overload for its bound arguments directly, past numba's
dispatcher (segment_steps._direct): the plan's values stay those of the node-by-node run and a float64
reference, on the MobileNetV3- and EfficientNet-style blocks of test_segment_fusion.py, batch 1 and 3."""

from __future__ import annotations

import numpy as np
import pytest
from onnx_runtime_ep_cpu.algorithms import segment_steps
from onnx_runtime_ep_cpu.compiled import deferred
from onnx_runtime_ep_cpu.compiled.segment_loops import hard_sigmoid_into
from reference64 import run_float64
from test_segment_fusion import _block_model, _segment_and_feeds


@pytest.mark.parametrize("gate", ["HardSigmoid", "Sigmoid"])
@pytest.mark.parametrize("batch", [1, 3])
def test_plan_calls_compiled_loops_past_the_dispatcher(gate, batch):
    model = _block_model(gate=gate)
    rng = np.random.default_rng(batch)
    x = rng.standard_normal((batch, 3, 12, 12)).astype(np.float32)
    deferred.wait_ready(240)
    segment, feeds = _segment_and_feeds(model, x)
    planned = segment(*feeds)
    ((plan,),) = segment.plans.values()
    functions = [f for f, _ in plan._steps]  # noqa: SLF001
    assert not any(isinstance(f, deferred.Loop) for f in functions)  # every compiled loop bound to its overload
    assert sum(type(f).__name__ == "builtin_function_or_method" and not isinstance(f, np.ufunc)
               for f in functions) >= 3
    x2 = rng.standard_normal(x.shape).astype(np.float32)
    feeds = [x2 if f is x else f for f in feeds]
    got = dict(zip(segment.output_names, segment(*feeds)))
    exact = dict(zip(["logits", "res"], run_float64(model, {"x": x2})))
    for name, wide in exact.items():
        assert got[name].shape == wide.shape and got[name].dtype == np.float32
        assert np.abs(got[name] - wide).max() <= 1e-5 * (1 + np.abs(wide).max()), name
    _, by_nodes = segment._node_by_node(feeds, keep_all=False)  # noqa: SLF001
    for a, b in zip(segment(*feeds), by_nodes):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert all(a.shape == b.shape for a, b in zip(planned, by_nodes))


def test_direct_overload_refuses_a_wrong_array_type():
    deferred.wait_ready(240)
    x = np.linspace(-4, 4, 9, dtype=np.float32)
    y = np.empty_like(x)
    arguments = (x, y, np.float32(0.2), np.float32(0.5), False)
    direct = segment_steps._direct(hard_sigmoid_into, arguments)  # noqa: SLF001
    assert not isinstance(direct, deferred.Loop)
    direct(*arguments)
    np.testing.assert_allclose(y, np.clip(0.2 * x.astype(np.float64) + 0.5, 0, 1), rtol=1e-6, atol=1e-7)
    with pytest.raises(TypeError):
        direct(x.astype(np.float64), y, np.float32(0.2), np.float32(0.5), False)


def test_functions_that_are_not_compiled_loops_are_kept():
    out = np.empty(3)
    assert segment_steps._direct(np.add, (np.ones(3), np.ones(3), out)) is np.add  # noqa: SLF001
