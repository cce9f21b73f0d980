"""A bound plan whose steps run as one run_chain call links run_chain only (algorithms/segment_steps.BoundPlan):
the chained loops are inside run_chain's own library, so their entry points are neither linked from numba's cache
nor compiled one by one. Counted in a fresh process (numba's Dispatcher.compile, through which a cached loop is
linked too) after a first process has filled the cache; the plan's outputs within float32 rounding of a float64
reference."""

from __future__ import annotations

import numpy as np
import pytest
from model_helpers import json_from_child, saved_for_child
from onnx_runtime_ep_cpu.algorithms import segment_chain
from onnx_runtime_ep_cpu.compiled import host
from reference64 import run_float64
from test_cnn_blocked_layout import _chain_model

pytestmark = pytest.mark.skipif(not host.AVX2, reason="the direct tiles (the chained loops' steps) need AVX2")

SCRIPT = r"""
import json, sys
import numpy as np
import numba.core.dispatcher as dispatcher
from onnx_runtime import session
from onnx_runtime_ep_cpu.ops import segment as segment_module
linked = []
original = dispatcher.Dispatcher.compile
def counted(self, sig):
    linked.append(self.py_func.__name__)
    return original(self, sig)
dispatcher.Dispatcher.compile = counted
made = []
real_init = segment_module.Segment.__init__
def init(self, node):
    real_init(self, node)
    made.append(self)
segment_module.Segment.__init__ = init
options = session.SessionOptions()
options.intra_op_num_threads = 1
options.add_session_config_entry("session.compile_in_background", "0")
sess = session.InferenceSession(sys.argv[1], sess_options=options)
x = np.load(sys.argv[2])
outputs = [sess.run(None, {"x": x})[0] for _ in range(2)]
np.save(sys.argv[3], outputs[-1])
calls = [getattr(f, "__name__", "") for s in made for ps in s.plans.values() for p in (ps or ()) for f, _ in p._calls]
print(json.dumps({"linked": linked, "calls": calls}))
"""


def test_a_chained_plan_links_run_chain_only(tmp_path):
    model = _chain_model()
    x = np.random.default_rng(4).standard_normal((2, 3, 13, 13)).astype(np.float32)
    model_path, x_path = saved_for_child(tmp_path, model, x, "chain")
    json_from_child(SCRIPT, model_path, x_path, tmp_path / "y.npy")  # (a cold cache compiles run_chain here,
    # which compiles its callees through their dispatchers too: the count is the next process's, linking only)
    found = json_from_child(SCRIPT, model_path, x_path, tmp_path / "y.npy")
    assert "run_chain" in found["calls"], "the model was expected to plan a chain"
    assert "run_chain" in found["linked"]
    assert not set(found["linked"]) & set(segment_chain.PATTERNS), found["linked"]
    got = np.load(tmp_path / "y.npy")
    (exact,) = run_float64(model, {"x": x})[:1]
    assert got.shape == exact.shape
    assert np.abs(got - exact).max() <= 1e-4 * (1 + np.abs(exact).max())
