"""A graph the provider resets as its capture ends is captured again (issue 21).

A release the capture held (another session's free of memory the graph reads, the end of a borrow) runs when the
capture ends and resets the graph that recorded the address; another thread may reset it too. The session's first
launch of that graph then finds it gone: that run goes eagerly and the next run of the signature captures again,
as after a reset seen before a replay. Only a capture that keeps failing leaves the signature eager. These cases run
on the CUDA provider's owner hooks and through the contract's defaults over its slot hooks; a reset between two
segments of a replay (owner hooks, a host seam between the segments) makes that replay eager.
"""

from __future__ import annotations

import numpy as np
import onnx_runtime as ort
import pytest
import test_device_graphs
from cuda_op_harness import kernel_file
from onnx_runtime.errors import ProviderError
from test_device_graphs import (
    SlotHooksOnlyCUDAExecutionProvider,
    axpb_model,
    capture_session,
    expected,
    host_provider,  # noqa: F401 - the fixture, requested by name below
)
from test_streams_lent_memory_cuda import BIAS, SHAPE, RawMemory, consumer, producer
from test_streams_session_sync_cuda import _elsewhere

cu = pytest.importorskip("onnx_runtime_ep_cuda.sim.driver", reason="the CUDA provider is not installed")

CUDA = "CUDAExecutionProvider"
SLOTS = SlotHooksOnlyCUDAExecutionProvider.__name__


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode, tmp_path_factory):
    test_device_graphs._source["path"] = kernel_file(tmp_path_factory, "graph_test_ops.cu",  # noqa: SLF001
                                                     test_device_graphs.TEST_KERNELS)


@pytest.fixture(params=[CUDA, SLOTS])
def provider(request):
    """The name the capturing session runs on: the owner hooks, or the contract's defaults over the slot hooks."""
    if request.param == SLOTS:
        ort.register_provider(SlotHooksOnlyCUDAExecutionProvider)
        yield SLOTS
        ort.unregister_provider(SLOTS)
    else:
        yield CUDA


def _session(model: bytes, name: str, capture: bool = False) -> ort.InferenceSession:
    options = ort.SessionOptions()
    if capture:
        options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(model, options, providers=[name])


def _consume_on(sess, name: str, tensor: ort.Tensor) -> np.ndarray:
    """``sess`` reads ``tensor`` in place (IO binding); its output, on the host."""
    handle = sess.provider_handle(name)
    out = ort.Tensor.empty(ort.DataType.FLOAT, tuple(tensor.shape), handle)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("h", ort.OrtValue(tensor))
    binding.bind_ortvalue_output("z", ort.OrtValue(out))
    sess.run_with_iobinding(binding)
    value = out.numpy()
    out.close()
    return value


def _reference(h: np.ndarray) -> np.ndarray:
    return np.tanh(h.astype(np.float64) + BIAS.astype(np.float64))


class _AtCaptureEnd:
    """On the capturing handle: runs ``action`` as each capture ends (before the provider ends it, or after with
    ``after``) while ``remaining`` is positive, and counts the captures begun."""

    def __init__(self, action, remaining: int = 1, after: bool = False):
        self.action, self.remaining, self.after, self.begun = action, remaining, after, 0

    @ort.hookimpl(tryfirst=True)
    def begin_owned_device_graph_capture(self, owner, slot, continuation, kernels):
        self.begun += 1

    @ort.hookimpl(wrapper=True)
    def end_owned_device_graph_capture(self, token):
        if self.remaining > 0 and not self.after:
            self.remaining -= 1
            self.action(token)
        result = yield
        if self.remaining > 0 and self.after:
            self.remaining -= 1
            self.action(token)
        return result


def _leak_free(*handles) -> None:
    for handle in handles:
        allocations, frees = handle.allocation_counts()
        assert allocations == frees
    device = handles[0].provider.cuda_device().shared
    assert device.allocations - device.frees == len(device._live)  # noqa: SLF001 - every free counted once


def _write_h(a, memory, x: np.ndarray):
    """A writes h = Relu(x @ w) into ``memory`` through an external binding (a borrow of that memory)."""
    kept = a.device_io_binding(ort.ExternalMemorySpec.output("h", np.float32, SHAPE, SHAPE, memory.ptr,
                                                             memory.nbytes))
    a.run_with_device_bindings([kept], input_feed={"x": x}, output_names=[])
    return kept


def test_a_release_held_by_the_capture_resets_its_graph_and_the_next_run_captures_again(provider):
    """A writes h into external memory it borrowed; B captures a run reading h there in place. A's binding is
    released from another thread while B's capture is open: the end of the borrow is held until the capture ends,
    then runs once and resets B's new graph. That run goes eagerly (right result); B's next run at the same address
    (same signature) captures again and later runs replay, each equal to the float64 reference. Before, the stale
    launch made the signature eager for good."""
    model_a, w = producer()
    a, b = _session(model_a, CUDA), _session(consumer(), provider, capture=True)
    handle_a, handle_b = a.provider_handle(CUDA), b.provider_handle(provider)
    device = handle_a.provider.cuda_device().shared
    memory = RawMemory(device, int(np.prod(SHAPE)) * 4)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(SHAPE).astype(np.float32)
    kept = _write_h(a, memory, x)
    h = ort.Tensor(ort.DataType.FLOAT, SHAPE, kept.buffer.alias(), handle_b)
    # Another thread releases A's binding: the capturing thread itself may not synchronize A's stream (a GPU
    # refuses it; the binding would be quarantined with a warning instead).
    hooks = _AtCaptureEnd(lambda token: _elsewhere(kept.close))
    handle_b.pm.register(hooks, name="release-at-capture-end")
    statuses = []
    try:
        for _ in range(2):  # warm-up, then the capture the held release resets
            np.testing.assert_allclose(_consume_on(b, provider, h), _reference(np.maximum(x.astype(np.float64) @ w, 0)),
                                       rtol=1e-5, atol=1e-6)
            statuses.append(b.device_graph_status())
    finally:
        handle_b.pm.unregister(hooks)
    assert hooks.remaining == 0 and memory.ptr not in device._lent  # noqa: SLF001 - the borrow ended once
    assert statuses[0].startswith("eager: warming up")
    assert statuses[1].startswith("eager: the provider reset the graph") and "captures again" in statuses[1], statuses
    runner = b._executor.graphs  # noqa: SLF001
    assert runner.counts["captures"] == 0
    kept = _write_h(a, memory, x)  # A binds the same memory again: B's feed keeps its address
    h = ort.Tensor(ort.DataType.FLOAT, SHAPE, kept.buffer.alias(), handle_b)
    for step in range(4):
        x = rng.standard_normal(SHAPE).astype(np.float32)
        a.run_with_device_bindings([kept], input_feed={"x": x}, output_names=[])
        np.testing.assert_allclose(_consume_on(b, provider, h), _reference(np.maximum(x.astype(np.float64) @ w, 0)),
                                   rtol=1e-5, atol=1e-6)
        assert b.device_graph_status() == "replaying", (step, b.device_graph_status())
    kept.close()
    assert runner.counts["captures"] == 1 and runner.counts["segment_captures"] == 2
    b.close()
    a.close()
    memory.close()
    _leak_free(handle_a, handle_b)


def _host_fed_session(provider):
    """A host-fed capture session (its signature has no device address): y = tanh(x + BIAS)."""
    return _session(consumer(), provider, capture=True)


def _run_host(sess, x):
    (y,) = sess.run(None, {"h": x})
    return y


def test_a_graph_reset_as_its_capture_ends_is_captured_again_with_the_same_signature(provider):
    """Another thread resets the graph right after its capture ends: that run is eager, the next run of the same feed
    signature captures again (no second warm-up) and later runs replay, each equal to the float64 reference."""
    sess = _host_fed_session(provider)
    handle = sess.provider_handle(provider)
    hooks = _AtCaptureEnd(lambda token: handle.hook.reset_owned_device_graph(token=token), after=True)
    handle.pm.register(hooks, name="reset-at-capture-end")
    rng = np.random.default_rng(2)
    statuses = []
    try:
        for _ in range(5):
            x = rng.standard_normal(SHAPE).astype(np.float32)
            np.testing.assert_allclose(_run_host(sess, x), _reference(x), rtol=1e-5, atol=1e-6)
            statuses.append(sess.device_graph_status())
    finally:
        handle.pm.unregister(hooks)
    assert statuses[0].startswith("eager: warming up")
    assert statuses[1].startswith("eager: the provider reset the graph"), statuses
    assert statuses[2:] == ["replaying"] * 3
    runner = sess._executor.graphs  # noqa: SLF001
    assert hooks.begun == 2 and runner.counts["captures"] == 1 and runner.counts["replays"] == 3
    sess.close()
    _leak_free(handle)


def test_a_graph_reset_at_every_capture_ends_eager(provider):
    """A reset at each capture (a reason that recurs) stops the recapturing after a bounded number of tries; the
    runs stay right throughout."""
    sess = _host_fed_session(provider)
    handle = sess.provider_handle(provider)
    hooks = _AtCaptureEnd(lambda token: handle.hook.reset_owned_device_graph(token=token), remaining=100,
                          after=True)
    handle.pm.register(hooks, name="reset-every-capture")
    rng = np.random.default_rng(3)
    try:
        for _ in range(8):
            x = rng.standard_normal(SHAPE).astype(np.float32)
            np.testing.assert_allclose(_run_host(sess, x), _reference(x), rtol=1e-5, atol=1e-6)
    finally:
        handle.pm.unregister(hooks)
    from onnx_runtime.session.device_graphs import MAX_CAPTURE_ATTEMPTS

    assert hooks.begun == MAX_CAPTURE_ATTEMPTS
    status = sess.device_graph_status()
    assert status.startswith("eager: the provider reset") and f"at each of its {MAX_CAPTURE_ATTEMPTS}" in status
    assert sess._executor.graphs.counts["captures"] == 0  # noqa: SLF001
    sess.close()
    _leak_free(handle)


def test_a_capture_that_fails_for_a_recurring_reason_still_ends_eager(provider):
    """A failure that is no reset (the provider refusing to end the capture) makes the signature eager at once, as
    before: one capture begun, every later run eager and right."""
    sess = _host_fed_session(provider)
    handle = sess.provider_handle(provider)

    def refuse(token):
        raise ProviderError("the test refuses to end this capture")

    hooks = _AtCaptureEnd(refuse, remaining=100)
    handle.pm.register(hooks, name="refuse-capture-end")
    rng = np.random.default_rng(4)
    try:
        for _ in range(5):
            x = rng.standard_normal(SHAPE).astype(np.float32)
            np.testing.assert_allclose(_run_host(sess, x), _reference(x), rtol=1e-5, atol=1e-6)
    finally:
        handle.pm.unregister(hooks)
    assert hooks.begun == 1
    status = sess.device_graph_status()
    assert status.startswith("eager: capture failed") and "refuses to end" in status, status
    sess.close()
    _leak_free(handle)


class _ResetBeforeSegment:
    """On the capturing handle: the first launch of segment ``index`` after registration finds the graph reset, as
    another thread's free of memory it recorded leaves it between two segments of one replay."""

    def __init__(self, handle, index: int):
        self.handle, self.index, self.fired = handle, index, False

    @ort.hookimpl(tryfirst=True)
    def replay_owned_device_graph_segment(self, token, index):
        if index == self.index and not self.fired:
            self.fired = True
            self.handle.hook.reset_owned_device_graph(token=token)


def test_a_graph_reset_between_two_segments_of_a_replay_runs_eagerly_and_captures_again(request):
    """Two segments with a host seam between them; the graph is reset after the first segment of a replay ran: that
    run goes eagerly with the right result (before, the stale launch raised to the caller), the next one warms up
    and the one after captures and replays."""
    ops = ("Axpb", "Axpb", "Axpb", "Axpb")
    session = capture_session(axpb_model(ops, host_node=1), providers=(CUDA, request.getfixturevalue("host_provider")))
    handle = session.provider_handle(CUDA)
    hooks = _ResetBeforeSegment(handle, 1)
    rng = np.random.default_rng(6)
    statuses = []
    for step in range(6):
        if step == 3:
            handle.pm.register(hooks, name="reset-between-segments")
        x = rng.standard_normal((2, 8)).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x.astype(np.float64), ops), rtol=1e-5, atol=1e-6)
        statuses.append(session.device_graph_status())
    handle.pm.unregister(hooks)
    assert hooks.fired
    assert statuses[2].startswith("replaying 2 graph segments") and statuses[3].startswith("eager: warming up")
    assert statuses[4].startswith("replaying 2 graph segments") and statuses[5] == statuses[4]
    assert session._executor.graphs.counts["captures"] == 2  # noqa: SLF001
    session.close()
    _leak_free(handle)
