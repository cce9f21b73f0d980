"""A plan's first run (its kernels linked and bound: objects that live as long as the plan) runs with the cyclic
collector paused and what it made promoted, as session creation and a specialization are: no collection of the
young generations scans them inside a later run. Later runs of the same plan run with the collector as it was."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from model_helpers import mul_relu_batch_model
from onnx_runtime import InferenceSession
from onnx_runtime.session import specialize
from onnx_runtime.session.executor import Executor


@pytest.mark.parametrize("enabled", (True, False))
def test_a_plans_first_run_is_paused_and_promoted(monkeypatch, enabled):
    monkeypatch.setattr(specialize, "_promotions", [specialize.PROMOTIONS])  # a fresh process's budget
    real = Executor.run
    states: list[bool] = []
    made: list[list] = []

    def run(self, *args, **kwargs):
        states.append(gc.isenabled())
        made.append([[i] for i in range(2000)])  # standing for the kernels a first run links, kept by the plan
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Executor, "run", run)
    was = gc.isenabled()
    try:
        if enabled:
            gc.enable()
        else:
            gc.disable()
        session = InferenceSession(mul_relu_batch_model(), providers=["CPUExecutionProvider"])
        rng = np.random.default_rng(5)
        for batch in (2, 2, 3, 3, 2):
            x = rng.standard_normal((batch, 4)).astype(np.float32)
            (y,) = session.run(None, {"X": x})
            np.testing.assert_allclose(y, np.maximum(x.astype(np.float64) * [0.5, -1.0, 2.0, 3.0], 0.0),
                                       rtol=1e-6, atol=1e-7)
            assert gc.isenabled() is enabled
        if enabled:
            assert states == [False, True, False, True, True]  # each plan's first run paused
            young = {id(o) for o in gc.get_objects(0) + gc.get_objects(1)}
            assert not any(id(o) in young for o in made[0][:200])  # promoted with the plan
        else:
            assert states == [False] * 5  # a collector the caller disabled stays so
    finally:
        if was:
            gc.enable()
        else:
            gc.disable()
