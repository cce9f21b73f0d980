"""A host KV cache (one head: compact rows) bound as both input and output: the view a run wrote its output into
is the next run's feed (no new view per step), and a caller that moves the logical length back between runs is
still fed what it set."""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
from model_helpers import make_model, tensor_info
from onnx import helper
from onnx_runtime import DeviceBindingSpec


def _kv_session():
    nodes = [helper.make_node("Concat", ["past", "new"], ["present"], axis=2),
             helper.make_node("ReduceSum", ["present"], ["total"], keepdims=0)]
    model = make_model(nodes, [tensor_info("past", shape=[1, 1, "past_len", 4]),
                               tensor_info("new", shape=[1, 1, 1, 4])],
                       [tensor_info("present", shape=[1, 1, "len", 4]), tensor_info("total", shape=[])])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_the_written_output_view_is_fed_next_and_a_rollback_is_honoured():
    session = _kv_session()
    kv = session.device_io_binding(DeviceBindingSpec.input(
        "past", np.float32, (1, 1, 8, 4), (1, 1, 0, 4), output_name="present", expose_logical_input_shape=True))
    rng = np.random.default_rng(3)
    reference = np.zeros((1, 1, 0, 4), np.float32)
    fed = []
    executor_for = session._executor_for  # noqa: SLF001  (white box: what the run feeds)

    def recording(feeds):
        fed.append(feeds["past"])
        return executor_for(feeds)

    session._executor_for = recording  # noqa: SLF001
    for step in range(6):
        if step == 4:  # the caller drops the last two rows (a rejected draft, say)
            kv.set_logical_shape((1, 1, 2, 4))
            reference = reference[:, :, :2]
        new = rng.standard_normal((1, 1, 1, 4)).astype(np.float32)
        (total,) = session.run_with_device_bindings([kv], {"new": new})
        reference = np.concatenate([reference, new], axis=2)
        np.testing.assert_allclose(total, reference.astype(np.float64).sum(), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(kv.read_logical(), reference)
    assert [f.shape[2] for f in fed] == [0, 1, 2, 3, 2, 3]
    # Every feed is a view of the binding's own buffer, never a copy.
    assert all(np.shares_memory(f, kv.host_array()) for f in fed if f.size)
    session.close()
