"""Deferred validation with its generation prologue inside the captured device graph (validation.py, graphs.py):
a replayed bound step begins its validation generation inside the graph (no eager clear, no carry copies), and the
flags still reach the binding that a run wrote, at its next host read, naming the node, also when a later run
carried them on the device (through the owner's carry word, and evacuated into the binding's own word when
another generation closes before the read)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import onnx_runtime as ort
import pytest
from model_helpers import make_model, tensor_info
from onnx import TensorProto, helper
from onnx_runtime import DeviceBindingSpec
from onnx_runtime.errors import DeviceValidationError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_device_graphs import CountingDriver  # noqa: E402

CUDA = "CUDAExecutionProvider"
VOCAB, HIDDEN = 16, 8
NODE = r"'lookup' \(Gather\)"


@pytest.fixture
def bound(cuda_driver_mode, monkeypatch):
    """A capturing session over a named Gather, its ids binding, two row bindings and a counting driver."""
    table = np.arange(VOCAB * HIDDEN, dtype=np.float32).reshape(VOCAB, HIDDEN)
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], axis=0, name="lookup")]
    model = make_model(nodes, [tensor_info("ids", TensorProto.INT64, [2])], [tensor_info("rows", shape=[2, HIDDEN])],
                       [onnx.numpy_helper.from_array(table, "table")])
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    sess = ort.InferenceSession(model.SerializeToString(), options, providers=[CUDA])
    ids = sess.device_io_binding(DeviceBindingSpec.input("ids", np.int64, (2,)))
    a = sess.device_io_binding(DeviceBindingSpec.output("rows", np.float32, (2, HIDDEN)))
    b = sess.device_io_binding(DeviceBindingSpec.output("rows", np.float32, (2, HIDDEN)))
    device = sess.provider_handle(CUDA).provider.cuda_device()
    counting = CountingDriver(device.driver)
    monkeypatch.setattr(device, "driver", counting)

    def run(values, out):
        ids.write_logical(np.array(values, np.int64))
        counting.calls.clear()
        sess.run_with_device_bindings([ids, out], output_names=[])
        return {call: n for call, n in counting.calls.items() if call != "cuCtxSetCurrent"}

    yield sess, table, a, b, run
    for binding in (ids, a, b):
        binding.close()


def test_a_replayed_step_begins_its_validation_inside_the_graph(bound):
    """Before, each replay enqueued the word's clear (a kernel launch) and a copy of the word into the output
    binding's word before its cuGraphLaunch; now the graph does both: one launch and the output's write."""
    sess, table, a, _b, run = bound
    for values in ([1, 2], [3, 4]):  # eager sizing run, capture
        run(values, a)
    for step in range(4):
        calls = run([step, step + 1], a)
        assert calls == {"cuGraphLaunch": 1, "cuMemcpyDtoDAsync": 1}, calls  # the graph; rows into the binding
    runner = sess._executor.graphs  # noqa: SLF001  (the runner's counts: white box)
    assert (runner.captures, runner.replays) == (1, 5)
    np.testing.assert_array_equal(a.read_logical(), table[[3, 4]])


@pytest.mark.filterwarnings("ignore:device binding 'rows' was released with a failed device validation")
def test_an_index_out_of_range_in_a_replayed_step_raises_at_the_read_naming_the_node(bound):
    sess, table, a, b, run = bound
    for values in ([1, 2], [3, 4], [5, 6]):  # eager, capture, replay
        run(values, a)
    run([2, VOCAB + 3], a)  # replayed with an index out of range: nothing read, nothing raised
    with pytest.raises(DeviceValidationError, match=rf"flags=0x1.*device binding 'rows'.*{NODE}"):
        a.read_logical()
    run([7, 8], a)  # a later valid run rewrites it
    np.testing.assert_array_equal(a.read_logical(), table[[7, 8]])

    # Carried on the device: a's run is left unread while a replay writes b; its flags move to the owner's carry
    # word inside b's graph launch, and a reads them there.
    run([VOCAB, 1], a)
    calls = run([9, 10], b)
    assert calls == {"cuGraphLaunch": 1, "cuMemcpyDtoDAsync": 1}, calls
    np.testing.assert_array_equal(b.read_logical(), table[[9, 10]])
    with pytest.raises(DeviceValidationError, match=NODE):
        a.read_logical()

    # Evacuated: a's flags wait in the carry word while two more generations close; the first of them copies them
    # into a's own word before the graph's prologue overwrites the carry word.
    run([VOCAB + 1, 0], a)
    run([11, 12], b)
    run([13, 14], b)
    np.testing.assert_array_equal(b.read_logical(), table[[13, 14]])
    with pytest.raises(DeviceValidationError, match=NODE):
        a.read_logical()
    assert sess.device_graph_status() == "replaying"


def test_a_replay_after_the_prologue_ran_keeps_the_flags_raised_before_it(cuda_handle):
    """The provider level: a graph that recorded an owner's prologue, launched in a generation whose prologue was
    already enqueued (a kernel asked for the word first), must not lose the flags raised before the launch."""
    from onnx_runtime.contract.graphs import DeviceGraphOwner, DeviceGraphSlot

    provider = cuda_handle.provider
    validation, graphs, device = provider.device_validation(), provider.device_graphs(), provider.cuda_device()
    registration = cuda_handle.hook.register_device_validation_owner()
    token = cuda_handle.hook.begin_device_validation(registration=registration)
    validation.prepare()
    owner = DeviceGraphOwner.new()
    graph = graphs.begin(owner, DeviceGraphSlot.PRIMARY)
    validation.current_word()  # a kernel of the capture asks for the word: the prologue is recorded
    graphs.end(graph)
    graphs.replay(graph)
    cuda_handle.hook.activate_device_validation(submission=token)
    assert cuda_handle.hook.consume_device_validation_error(registration=registration, token=token) == 0

    token = cuda_handle.hook.begin_device_validation(registration=registration)
    word = validation.current_word()  # the prologue runs eagerly, then a kernel raises a flag
    flag = np.array([1], np.uint32).view(np.uint8)
    device.upload(word, flag)
    graphs.replay(graph)  # its recorded prologue moves the flag to the carry word; the merge brings it back
    cuda_handle.hook.activate_device_validation(submission=token)
    assert cuda_handle.hook.consume_device_validation_error(registration=registration, token=token) == 1
    graphs.retire(owner)
    cuda_handle.hook.unregister_device_validation_owner(registration=registration)
