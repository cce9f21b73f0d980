"""Device graphs on the CUDA provider: the owner/slot/generation hooks, and session capture and replay.

Runs on the simulator (``ONNX_RUNTIME_CUDA_SIM=1``) by default; with ``ONNX_RUNTIME_CUDA_TESTS=real``
the same tests run against the real driver on a GPU machine. The session tests use operators of a
test-only domain whose kernels live in ``TEST_KERNELS`` below, so they do not depend on which standard
operators the provider implements.
"""

from __future__ import annotations

import os

import numpy as np
import onnx_runtime as ort
import pytest
from cuda_op_harness import kernel_file
from onnx import TensorProto, helper
from onnx_runtime import DataType, DeviceGraphOwner, DeviceGraphSlot, DeviceGraphToken, ProviderHandle
from onnx_runtime.errors import InvalidArgumentError, ProviderError

driver = pytest.importorskip("onnx_runtime_ep_cuda.driver", reason="the CUDA provider is not installed")
from onnx_runtime_ep_cuda import CUDAExecutionProvider  # noqa: E402
from onnx_runtime_ep_cuda.driver_counts import CountingDriver  # noqa: E402, F401 (other tests import it here)
from onnx_runtime_ep_cuda.ops.context import f32, i64, ptr  # noqa: E402
from onnx_runtime_ep_cuda.ops.registry import register  # noqa: E402

REAL = os.environ.get("ONNX_RUNTIME_CUDA_TESTS", "").lower() == "real"
PRIMARY, VERIFY = DeviceGraphSlot.PRIMARY, DeviceGraphSlot.VERIFY
DOMAIN = "test.cuda_graphs"
CUDA = "CUDAExecutionProvider"

TEST_KERNELS = r"""
extern "C" __global__ void axpb_f32(float* y, const float* x, float alpha, float beta, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = alpha * x[i] + beta;
}
"""
_source = {}  # "path": the kernel file, written once per test session


@pytest.fixture(autouse=True)
def mode(cuda_driver_mode, tmp_path_factory):
    _source["path"] = kernel_file(tmp_path_factory, "graph_test_ops.cu", TEST_KERNELS)


@pytest.fixture
def handle(cuda_handle):
    return cuda_handle


def graphs_of(h: ProviderHandle):
    return h.provider.device_graphs()


def all_destroyed(h: ProviderHandle) -> bool:
    graphs = graphs_of(h)
    return graphs.instantiated == graphs.destroyed


# -- test-only operators -------------------------------------------------------------------------------------------
def _axpb_factory(capturable=None, read_on_host=False):
    def factory(node, shapes, opset, ctx):
        function = ctx.function(_source["path"], "axpb_f32")
        alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 0.0)

        def kernel(x):
            if read_on_host:  # data-dependent host logic: synchronizes, so it cannot be captured
                alpha_now = alpha + float(x.numpy().reshape(-1)[:1].sum()) * 0
            else:
                alpha_now = alpha
            y = ctx.empty_like(x)
            ctx.launch_1d(function, x.numel, ptr(y), ptr(x), f32(alpha_now), f32(beta), i64(x.numel))
            return (y,)

        if capturable is not None:
            kernel.capturable = capturable
        return kernel
    return factory


@register("AxpbChurn", domain=DOMAIN, dtypes={DataType.FLOAT})
def _axpb_churn(node, shapes, opset, ctx):
    """Axpb whose kernel replaces a scratch tensor at every call, freeing the previous one."""
    axpb = _axpb_factory()(node, shapes, opset, ctx)
    state = {}

    def kernel(x):
        state["scratch"] = ctx.empty(DataType.FLOAT, (64,))  # the old one is freed here
        return axpb(x)
    return kernel


@register("AxpbGrowing", domain=DOMAIN, dtypes={DataType.FLOAT})
def _axpb_growing(node, shapes, opset, ctx):
    """Axpb with a temporary buffer of 64 KiB more at every call: the capture outgrows the warm-up's arena."""
    axpb = _axpb_factory()(node, shapes, opset, ctx)
    calls = []

    def kernel(x):
        calls.append(None)
        ctx.empty(DataType.UINT8, (65536 * len(calls),))  # dropped at once
        return axpb(x)
    return kernel


register("Axpb", domain=DOMAIN, dtypes={DataType.FLOAT})(_axpb_factory())
register("AxpbNoCapture", domain=DOMAIN, dtypes={DataType.FLOAT})(_axpb_factory(capturable=False))
register("AxpbHostRead", domain=DOMAIN, dtypes={DataType.FLOAT})(_axpb_factory(read_on_host=True))


def axpb_model(ops=("Axpb", "Axpb", "Axpb"), shape=("N", 8), annotate=True, host_node=None):
    """x -> ops[0] -> ops[1] -> ... -> y, each y = alpha * x + beta with alpha = i + 2, beta = i.

    Node ``host_node`` (an index) is put in the test.host domain, which only a host test provider runs.
    """
    nodes, value_info, current = [], [], "x"
    for i, op in enumerate(ops):
        out = "y" if i == len(ops) - 1 else f"t{i}"
        domain = "test.host" if i == host_node else DOMAIN
        nodes.append(helper.make_node(op, [current], [out], name=f"n{i}", domain=domain,
                                      alpha=float(i + 2), beta=float(i)))
        if annotate and out != "y":
            value_info.append(helper.make_tensor_value_info(out, TensorProto.FLOAT, list(shape)))
        current = out
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
                              value_info=value_info)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1), helper.make_opsetid("test.host", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


def expected(x, ops):
    """The chain in float64: a GPU contracts each a*x+b to one rounding (FMA), numpy's float32 rounds twice, so results
    near zero differ relatively; the tests compare with an absolute bound too."""
    x = np.asarray(x, np.float64)
    for i, _ in enumerate(ops):
        x = (i + 2) * x + i
    return x


def capture_session(model, providers=(CUDA,), capture=True):
    options = ort.SessionOptions()
    if capture:
        options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(model, options, providers=list(providers))


# -- provider hooks: owners, slots, generations ---------------------------------------------------------------------
def fill_capture(h, buffer, value, nbytes=None):
    """Record one kernel that fills ``buffer`` with the byte ``value``."""
    h.provider.fill(buffer, value, 0, nbytes)


def read(h, buffer, n=16):
    out = np.empty(n, np.uint8)
    h.copy_to_host(buffer, out)
    return out


def test_capture_replay_and_generations(handle):
    buffer = handle.allocate(16, 256)
    owner = DeviceGraphOwner.new()
    handle.provider.fill(buffer, 0)
    token = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=[])
    assert isinstance(token, DeviceGraphToken) and token.owner == owner and token.slot is PRIMARY
    fill_capture(handle, buffer, 7)
    assert not handle.hook.has_owned_device_graph(token=token)  # not installed while capturing
    handle.hook.end_owned_device_graph_capture(token=token)
    assert (read(handle, buffer) == 0).all()  # captured work does not run
    assert handle.hook.has_owned_device_graph(token=token)
    handle.hook.replay_owned_device_graph(token=token)
    assert (read(handle, buffer) == 7).all()

    # Re-capture mints a new generation; the old token neither replays, nor resets the new graph.
    newer = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=[])
    assert newer.generation > token.generation
    fill_capture(handle, buffer, 9)
    handle.hook.end_owned_device_graph_capture(token=newer)
    assert not handle.hook.has_owned_device_graph(token=token)
    with pytest.raises(InvalidArgumentError, match="stale"):
        handle.hook.replay_owned_device_graph(token=token)
    assert handle.hook.reset_owned_device_graph(token=token) is False
    assert handle.hook.has_owned_device_graph(token=newer)
    handle.hook.replay_owned_device_graph(token=newer)
    assert (read(handle, buffer) == 9).all()

    assert handle.hook.reset_owned_device_graph(token=newer) is True
    assert handle.hook.reset_owned_device_graph(token=newer) is False  # exactly once
    assert not handle.hook.has_owned_device_graph(token=newer)
    with pytest.raises(InvalidArgumentError):
        handle.hook.replay_owned_device_graph(token=newer)
    assert all_destroyed(handle) and graphs_of(handle).instantiated == 2
    handle.hook.retire_owned_device_graphs(owner=owner)
    handle.deallocate(buffer)


def test_foreign_owner_tokens_touch_nothing(handle):
    buffer = handle.allocate(16, 256)
    mine, other = DeviceGraphOwner.new(), DeviceGraphOwner.new()
    token = handle.hook.begin_owned_device_graph_capture(owner=mine, slot=PRIMARY, continuation=None, kernels=[])
    fill_capture(handle, buffer, 3)
    handle.hook.end_owned_device_graph_capture(token=token)
    forged = DeviceGraphToken(other, PRIMARY, token.generation)
    assert not handle.hook.has_owned_device_graph(token=forged)
    assert handle.hook.reset_owned_device_graph(token=forged) is False
    with pytest.raises(InvalidArgumentError):
        handle.hook.replay_owned_device_graph(token=forged)
    assert handle.hook.has_owned_device_graph(token=token)
    with pytest.raises(InvalidArgumentError):
        handle.hook.replay_owned_device_graph(token="not a token")
    handle.hook.retire_owned_device_graphs(owner=mine)
    assert not handle.hook.has_owned_device_graph(token=token)
    assert all_destroyed(handle)
    handle.deallocate(buffer)


def test_primary_and_verify_slots_are_independent(handle):
    a, b = handle.allocate(16, 256), handle.allocate(16, 256)
    for buffer in (a, b):
        handle.provider.fill(buffer, 0)
    owner = DeviceGraphOwner.new()
    primary = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=[])
    fill_capture(handle, a, 1)
    handle.hook.end_owned_device_graph_capture(token=primary)
    verify = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=VERIFY, continuation=None, kernels=[])
    fill_capture(handle, b, 2)
    handle.hook.end_owned_device_graph_capture(token=verify)
    handle.hook.replay_owned_device_graph(token=verify)
    assert (read(handle, a) == 0).all() and (read(handle, b) == 2).all()
    assert handle.hook.reset_owned_device_graph(token=verify)
    assert handle.hook.has_owned_device_graph(token=primary)  # resetting VERIFY leaves PRIMARY installed
    handle.hook.replay_owned_device_graph(token=primary)
    assert (read(handle, a) == 1).all()
    handle.hook.retire_owned_device_graphs(owner=owner)
    assert all_destroyed(handle)
    for buffer in (a, b):
        handle.deallocate(buffer)


def test_segmented_capture_with_continuation_tokens(handle):
    a, b = handle.allocate(16, 256), handle.allocate(16, 256)
    for buffer in (a, b):
        handle.provider.fill(buffer, 0)
    owner = DeviceGraphOwner.new()
    token = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=[])
    fill_capture(handle, a, 1)
    handle.hook.end_owned_device_graph_capture(token=token)
    handle.provider.fill(b, 5)  # an eager seam between the segments
    again = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=token, kernels=[])
    assert again == token  # a later segment extends the same generation
    fill_capture(handle, b, 2)
    handle.hook.end_owned_device_graph_capture(token=token)
    assert graphs_of(handle).segment_count(token) == 2

    handle.hook.replay_owned_device_graph_segment(token=token, index=1)
    assert (read(handle, a) == 0).all() and (read(handle, b) == 2).all()
    handle.provider.fill(b, 0)
    handle.hook.replay_owned_device_graph(token=token)  # every segment, in capture order
    assert (read(handle, a) == 1).all() and (read(handle, b) == 2).all()
    with pytest.raises(InvalidArgumentError, match="segment 2"):
        handle.hook.replay_owned_device_graph_segment(token=token, index=2)

    stale = DeviceGraphToken(owner, PRIMARY, token.generation + 100)
    with pytest.raises(InvalidArgumentError, match="continuation"):
        handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=stale, kernels=[])
    assert handle.hook.reset_owned_device_graph(token=token) is True
    with pytest.raises(InvalidArgumentError, match="continuation"):  # nothing installed to extend any more
        handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=token, kernels=[])
    handle.hook.retire_owned_device_graphs(owner=owner)
    assert all_destroyed(handle) and graphs_of(handle).destroyed == 2
    for buffer in (a, b):
        handle.deallocate(buffer)


def _stream_capturing(h) -> bool:
    device = h.provider.cuda_device()
    d = device.driver
    status = driver.check(d, d.cuStreamIsCapturing(device.compute), "cuStreamIsCapturing")
    return int(status) != int(d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


def test_abort_ends_the_capture_so_reset_succeeds(handle):
    buffer = handle.allocate(16, 256)
    handle.provider.fill(buffer, 0)
    owner = DeviceGraphOwner.new()
    first = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=[])
    fill_capture(handle, buffer, 1)
    handle.hook.end_owned_device_graph_capture(token=first)
    second = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=first, kernels=[])
    fill_capture(handle, buffer, 2)
    assert _stream_capturing(handle)
    with pytest.raises(ProviderError, match="still capturing"):
        handle.hook.reset_owned_device_graph(token=second)
    with pytest.raises(ProviderError, match="already in progress"):  # one capture at a time on the stream
        handle.hook.begin_owned_device_graph_capture(owner=DeviceGraphOwner.new(), slot=VERIFY, continuation=None,
                                                     kernels=[])
    handle.hook.abort_owned_device_graph_capture(token=second)
    assert not _stream_capturing(handle)
    handle.hook.abort_owned_device_graph_capture(token=second)  # nothing in progress: no-op
    assert graphs_of(handle).segment_count(first) == 1  # the aborted segment was discarded
    assert handle.hook.reset_owned_device_graph(token=first) is True
    assert all_destroyed(handle)

    # A capture the stream invalidated (a host synchronization inside it) is ended by abort as well.
    third = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=[])
    with pytest.raises(ProviderError):
        handle.provider.cuda_device().download(np.empty(16, np.uint8), buffer.ptr)
    handle.hook.abort_owned_device_graph_capture(token=third)
    assert not _stream_capturing(handle)
    assert handle.hook.reset_owned_device_graph(token=third) is False  # nothing was installed
    handle.hook.retire_owned_device_graphs(owner=owner)
    handle.deallocate(buffer)


def test_a_failed_capture_installs_nothing(handle):
    buffer = handle.allocate(16, 256)
    owner = DeviceGraphOwner.new()
    token = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=PRIMARY, continuation=None, kernels=[])
    with pytest.raises(ProviderError):
        handle.provider.cuda_device().sync()  # synchronizing a capturing stream invalidates the capture
    with pytest.raises(ProviderError, match="capture was discarded"):
        handle.hook.end_owned_device_graph_capture(token=token)
    assert not _stream_capturing(handle)
    assert not handle.hook.has_owned_device_graph(token=token)
    assert handle.hook.reset_owned_device_graph(token=token) is False
    handle.hook.retire_owned_device_graphs(owner=owner)
    assert all_destroyed(handle)
    handle.deallocate(buffer)


def test_slot_hooks_accumulate_segments_until_reset(handle):
    buffer = handle.allocate(16, 256)
    handle.provider.fill(buffer, 0)
    assert not handle.hook.has_device_graph_in(slot=VERIFY)
    assert handle.hook.reset_device_graph_in(slot=VERIFY) is False
    with pytest.raises(InvalidArgumentError):
        handle.hook.replay_device_graph_in(slot=VERIFY)
    handle.hook.begin_device_graph_capture_in(slot=VERIFY, kernels=[])
    fill_capture(handle, buffer, 4, 8)
    handle.hook.end_device_graph_capture_in(slot=VERIFY)
    handle.hook.begin_device_graph_capture_in(slot=VERIFY, kernels=[])
    handle.hook.abort_device_graph_capture_in(slot=VERIFY)  # the aborted second segment leaves the first
    assert handle.hook.has_device_graph_in(slot=VERIFY)
    handle.hook.replay_device_graph_in(slot=VERIFY)
    assert (read(handle, buffer)[:8] == 4).all() and (read(handle, buffer)[8:] == 0).all()

    # The single-slot hooks are the PRIMARY slot.
    handle.hook.begin_device_graph_capture(kernels=[])
    fill_capture(handle, buffer, 6, 8)
    handle.hook.end_device_graph_capture()
    handle.hook.replay_device_graph()
    assert (read(handle, buffer)[:8] == 6).all()
    assert handle.hook.has_device_graph_in(slot=PRIMARY) and handle.hook.has_device_graph_in(slot=VERIFY)
    assert handle.hook.reset_device_graph() is True
    assert handle.hook.reset_device_graph_in(slot=VERIFY) is True
    assert not handle.hook.has_device_graph_in(slot=VERIFY)
    assert all_destroyed(handle)
    handle.deallocate(buffer)


def test_a_reset_sweep_over_every_slot_is_safe(handle):
    """Iterating DeviceGraphSlot yields the real slots only (COUNT is not one), so a sweep resets each."""
    assert list(DeviceGraphSlot) == [PRIMARY, VERIFY] and len(DeviceGraphSlot) == DeviceGraphSlot.COUNT
    buffer = handle.allocate(16, 256)
    owner = DeviceGraphOwner.new()
    tokens = []
    for slot in DeviceGraphSlot:
        token = handle.hook.begin_owned_device_graph_capture(owner=owner, slot=slot, continuation=None, kernels=[])
        fill_capture(handle, buffer, 1 + slot, 8)
        handle.hook.end_owned_device_graph_capture(token=token)
        tokens.append(token)
        handle.hook.begin_device_graph_capture_in(slot=slot, kernels=[])
        fill_capture(handle, buffer, 3 + slot, 8)
        handle.hook.end_device_graph_capture_in(slot=slot)
    assert [handle.hook.reset_device_graph_in(slot=slot) for slot in DeviceGraphSlot] == [True, True]
    assert [handle.hook.reset_device_graph_in(slot=slot) for slot in DeviceGraphSlot] == [False, False]
    assert [handle.hook.reset_owned_device_graph(token=token) for token in tokens] == [True, True]
    with pytest.raises(InvalidArgumentError, match="not a device graph slot"):
        handle.hook.reset_device_graph_in(slot=DeviceGraphSlot.COUNT)
    assert all_destroyed(handle)
    handle.hook.retire_owned_device_graphs(owner=owner)
    handle.deallocate(buffer)


def test_shutdown_destroys_what_is_left():
    h = ProviderHandle(CUDAExecutionProvider())
    h.initialize({})
    graphs = graphs_of(h)
    buffer = h.allocate(16, 256)
    token = h.hook.begin_owned_device_graph_capture(owner=DeviceGraphOwner.new(), slot=PRIMARY, continuation=None,
                                                    kernels=[])
    fill_capture(h, buffer, 1)
    h.hook.end_owned_device_graph_capture(token=token)
    h.deallocate(buffer)
    h.hook.begin_owned_device_graph_capture(owner=DeviceGraphOwner.new(), slot=VERIFY, continuation=None, kernels=[])
    h.shutdown()  # one installed graph and one capture in progress
    assert graphs.instantiated == graphs.destroyed == 1
    assert not _stream_capturing(h)


# -- session capture and replay -------------------------------------------------------------------------------------
def test_replayed_runs_equal_eager_runs():
    ops = ("Axpb", "Axpb", "Axpb")
    session = capture_session(axpb_model(ops))
    assert all(p.provider == CUDA for p in session.placement())
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((3, 8)).astype(np.float32) for _ in range(4)]
    runner = session._executor.graphs
    statuses = []
    for x in xs:
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, ops), rtol=1e-6, atol=1e-5)
        statuses.append(session.device_graph_status())
    assert statuses[0].startswith("eager: warming up")
    assert statuses[1:] == ["replaying"] * 3
    assert runner.captures == 1 and runner.replays == 3

    # New shapes: warm up, capture, replay again, while the first graph stays installed.
    x = rng.standard_normal((5, 8)).astype(np.float32)
    for status in ("eager: warming up", "replaying", "replaying"):
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, ops), rtol=1e-6, atol=1e-5)
        assert session.device_graph_status().startswith(status)
    (y,) = session.run(None, {"x": xs[0]})
    np.testing.assert_allclose(y, expected(xs[0], ops), rtol=1e-6, atol=1e-5)
    assert runner.captures == 2 and runner.replays == 6
    graphs = graphs_of(session.provider_handle("cuda"))
    session.close()
    assert graphs.instantiated == graphs.destroyed == 2


def test_capture_is_off_by_default_and_the_option_is_checked():
    session = capture_session(axpb_model(), capture=False)
    session.run(None, {"x": np.ones((2, 8), np.float32)})
    assert session.device_graph_status().startswith("eager: device graph capture is off")
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "yes")
    with pytest.raises(InvalidArgumentError, match="session.graph_capture"):
        ort.InferenceSession(axpb_model(), options, providers=[CUDA])


def test_the_arena_keeps_addresses_and_frees_everything():
    counts = []
    session = capture_session(axpb_model(("Axpb",) * 5))
    handle = session.provider_handle("cuda")
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    for _ in range(4):
        (y,) = session.run(None, {"x": x})
        counts.append(handle.allocation_counts())
    np.testing.assert_allclose(y, expected(x, ("Axpb",) * 5), rtol=1e-6, atol=1e-5)
    assert counts[3] == counts[2]  # replays allocate nothing
    runner = session._executor.graphs
    (entry,) = runner._entries[PRIMARY].values()
    # Each step frees its input after allocating its output, so five steps alternate between two blocks.
    assert entry.arena.layout.top == 2 * 256 <= entry.arena_bytes
    session.close()
    allocations, frees = handle.allocation_counts()
    assert allocations == frees


@pytest.fixture
def host_provider():
    class TestHostExecutionProvider:
        @ort.hookimpl
        def name(self):
            return "TestHostExecutionProvider"

        @ort.hookimpl
        def supports_op(self, node):
            if node.domain == "test.host":
                return ort.KernelMatch.supported(cost=1.0)
            return ort.KernelMatch.unsupported("runs only test.host operators")

        @ort.hookimpl
        def get_kernel(self, node):
            alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 0.0)
            return lambda x: ((alpha * x + beta).astype(np.float32),)

    ort.register_provider(TestHostExecutionProvider)
    yield "TestHostExecutionProvider"
    ort.unregister_provider("TestHostExecutionProvider")


def test_unresolved_shapes_leave_nothing_to_capture():
    # Unannotated outputs alone would not do: the CUDA kernels declare their host inputs (none here), so the
    # session derives their output shapes from resolved input shapes; an input dim no name ties to the feeds does.
    ops = ("Axpb",) * 3
    session = capture_session(axpb_model(ops, shape=(None, 8), annotate=False))
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    for _ in range(3):
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, ops), rtol=1e-6, atol=1e-5)
        assert session.device_graph_status() == (
            "eager: node 'n0' (Axpb): data-dependent output shape was unresolved before capture")
    assert session._executor.graphs.captures == 0
    session.close()


def _check_leaks(session):
    handle = session.provider_handle("cuda")
    graphs = graphs_of(handle)
    session.close()
    assert graphs.instantiated == graphs.destroyed
    allocations, frees = handle.allocation_counts()
    assert allocations == frees


def test_a_host_node_between_device_nodes_is_an_eager_seam_between_two_segments(host_provider):
    """Before segmented capture, one host node made the whole run eager (0 captures)."""
    ops = ("Axpb", "Axpb", "Axpb", "Axpb")
    session = capture_session(axpb_model(ops, host_node=1), providers=(CUDA, host_provider))
    runner = session._executor.graphs
    rng = np.random.default_rng(1)
    statuses = []
    for _ in range(5):  # new values every run: the seam's pinned value and the persistent input are refreshed
        x = rng.standard_normal((2, 8)).astype(np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, ops), rtol=1e-5, atol=1e-5)
        statuses.append(session.device_graph_status())
    assert statuses[0].startswith("eager: warming up")
    assert statuses[1:] == ["replaying 2 graph segments with eager seams (node 'n1' (Axpb) runs on "
                            "TestHostExecutionProvider, a host provider)"] * 4
    assert runner.counts == {"captures": 1, "replays": 4, "segment_captures": 2, "segment_replays": 8,
                             "seam_steps": 3 * 3}  # per replay: download, host node, upload into the pin
    assert graphs_of(session.provider_handle("cuda")).instantiated == 2
    _check_leaks(session)


def test_a_seam_first_and_last(host_provider):
    ops = ("Axpb", "Axpb", "Axpb")
    nodes, current = [], "x"
    for i, op in enumerate(ops):  # n0 and n2 on the host, n1 on the device
        out = "y" if i == 2 else f"t{i}"
        nodes.append(helper.make_node(op, [current], [out], name=f"n{i}", domain=DOMAIN if i == 1 else "test.host",
                                      alpha=float(i + 2), beta=float(i)))
        current = out
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["N", 8]) for n in ("t0", "t1")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 8])], value_info=vi)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1), helper.make_opsetid("test.host", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()
    session = capture_session(model, providers=(CUDA, host_provider))
    for value in (1.0, 2.0, -3.0, 0.5):
        x = np.full((3, 8), value, np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, ops), rtol=1e-6, atol=1e-5)
    assert session.device_graph_status().startswith("replaying 1 graph segment with eager seams (node 'n0'")
    assert session._executor.graphs.counts["segment_captures"] == 1
    _check_leaks(session)


def test_a_kernel_found_not_capturable_at_capture_becomes_a_seam():
    """The kernel of a node cached per shape is known only once the run's shapes are: the capture that meets it
    refuses it, and the next one captures the segments around it."""
    ops = ("Axpb", "AxpbNoCapture", "Axpb")
    session = capture_session(axpb_model(ops))
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    statuses = []
    for _ in range(4):
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, ops), rtol=1e-6, atol=1e-5)
        statuses.append(session.device_graph_status())
    assert statuses[0].startswith("eager: warming up")
    assert statuses[1] == ("eager: node 'n1' (AxpbNoCapture): its kernel is marked not capturable; the next run "
                           "captures the segments around it")
    assert statuses[2:] == ["replaying 2 graph segments with eager seams (node 'n1' (AxpbNoCapture): its kernel "
                            "is marked not capturable)"] * 2
    assert session._executor.graphs.counts["segment_captures"] == 2
    _check_leaks(session)


def test_a_kernel_that_synchronizes_fails_the_capture_and_runs_eagerly():
    ops = ("Axpb", "AxpbHostRead", "Axpb")
    session = capture_session(axpb_model(ops))
    x = np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)
    for _ in range(4):
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, ops), rtol=1e-6, atol=1e-5)
    status = session.device_graph_status()
    assert status.startswith("eager: capture failed at node 'n1'"), status
    graphs = graphs_of(session.provider_handle("cuda"))
    assert not _stream_capturing(session.provider_handle("cuda"))
    assert graphs.instantiated == graphs.destroyed == 0
    handle = session.provider_handle("cuda")
    session.close()
    allocations, frees = handle.allocation_counts()
    assert allocations == frees


def test_a_buffer_freed_during_a_capture_is_freed_after_it():
    """Freeing it inside the capture would record the free into the graph, repeated at every replay."""
    ops = ("Axpb", "AxpbChurn", "Axpb")
    session = capture_session(axpb_model(ops))
    handle = session.provider_handle("cuda")
    x = np.ones((2, 8), np.float32)
    for _ in range(4):
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, ops), rtol=1e-6, atol=1e-5)
    assert session.device_graph_status() == "replaying"
    session.close()
    # The warm-up's scratch, dropped during the capture, was freed after it; the scratch the kernel still
    # holds came from the arena, which is no provider allocation.
    allocations, frees = handle.allocation_counts()
    assert allocations == frees


def test_an_arena_too_small_is_grown_and_the_capture_retried():
    ops = ("Axpb", "AxpbGrowing")
    session = capture_session(axpb_model(ops))
    x = np.ones((2, 8), np.float32)
    statuses = []
    for _ in range(4):
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, ops), rtol=1e-6, atol=1e-5)
        statuses.append(session.device_graph_status())
    assert statuses[0].startswith("eager: warming up")
    assert statuses[1].startswith("eager: the capture arena was too small")
    assert statuses[2:] == ["replaying", "replaying"]
    assert session._executor.graphs.captures == 1
    handle = session.provider_handle("cuda")
    session.close()
    allocations, frees = handle.allocation_counts()
    assert allocations == frees


def test_a_graph_reset_out_of_band_is_captured_again():
    session = capture_session(axpb_model())
    x = np.ones((2, 8), np.float32)
    for _ in range(2):
        session.run(None, {"x": x})
    runner = session._executor.graphs
    (entry,) = runner._entries[PRIMARY].values()
    handle = session.provider_handle("cuda")
    assert handle.hook.reset_owned_device_graph(token=entry.token)  # e.g. the provider evicted it
    for status in ("eager: warming up", "replaying"):
        (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, expected(x, ("Axpb",) * 3), rtol=1e-6, atol=1e-5)
        assert session.device_graph_status().startswith(status)
    assert runner.captures == 2
    session.close()


def test_many_shapes_keep_a_bounded_number_of_graphs():
    from onnx_runtime.session.device_graphs import MAX_GRAPHS

    session = capture_session(axpb_model(("Axpb",)))
    for rows in range(1, MAX_GRAPHS + 3):
        x = np.ones((rows, 8), np.float32)
        for _ in range(2):
            (y,) = session.run(None, {"x": x})
        np.testing.assert_allclose(y, np.full((rows, 8), 2.0, np.float32))
    runner = session._executor.graphs
    assert len(runner._entries[PRIMARY]) == MAX_GRAPHS
    graphs = graphs_of(session.provider_handle("cuda"))
    assert graphs.instantiated == MAX_GRAPHS + 2 and graphs.destroyed == 2
    session.close()
    assert graphs.destroyed == graphs.instantiated


def test_kernel_arguments_are_baked_but_feeds_are_not():
    """A replay reads the persistent input buffers (refreshed each run), not the feeds of the capture run."""
    session = capture_session(axpb_model(("Axpb",), shape=(4,)))
    for value in (1.0, 2.0, 3.0, -4.0):
        x = np.full(4, value, np.float32)
        (y,) = session.run(None, {"x": x})
        np.testing.assert_array_equal(y, 2 * x)
    assert session.device_graph_status() == "replaying"
    session.close()


def test_graph_outputs_that_are_feeds_pass_through():
    nodes = [helper.make_node("Axpb", ["x"], ["y"], name="n0", domain=DOMAIN, alpha=2.0, beta=0.0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4]),
                               helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)],
                              ir_version=9).SerializeToString()
    session = capture_session(model)
    for value in (1.0, 5.0, 7.0):
        x = np.full(4, value, np.float32)
        y, x_out = session.run(None, {"x": x})
        np.testing.assert_array_equal(y, 2 * x)
        np.testing.assert_array_equal(x_out, x)
    assert session.device_graph_status() == "replaying"
    session.close()


@pytest.mark.parametrize("capture", [False, True])
def test_device_resident_runs_do_not_synchronize_with_the_host(capture, monkeypatch):
    """Outputs kept on the device, or written into a bound device buffer, are copied on the stream: neither an
    eager run nor a replay waits for the device (the download that reads the result does)."""
    ops = ("Axpb", "Axpb")
    session = capture_session(axpb_model(ops, shape=(4, 8)), capture=capture)
    handle = session.provider_handle("cuda")
    device = handle.provider.cuda_device().shared  # the device every lane synchronizes through
    waits = []
    synchronize = device._synchronize
    monkeypatch.setattr(device, "_synchronize", lambda stream, which: (waits.append(which),
                                                                       synchronize(stream, which)))
    rng = np.random.default_rng(3)
    bound = ort.Tensor.zeros(ort.DataType.FLOAT, (4, 8), provider=handle)
    feed = ort.Tensor.zeros(ort.DataType.FLOAT, (4, 8), provider=handle)  # one address: one signature
    for keep in ("kept", "bound"):
        binding = session.io_binding()
        binding.bind_ortvalue_input("x", ort.OrtValue(feed))
        if keep == "kept":
            binding.bind_output("y", "cuda", 0)
        else:
            binding.bind_output("y", "cuda", 0, np.float32, [4, 8], bound.device_ptr)
        for _ in range(4):
            x = rng.standard_normal((4, 8)).astype(np.float32)
            handle.copy_from_host(x, feed.buffer)  # an upload waits, before the run
            waits.clear()
            session.run_with_iobinding(binding)
            assert waits == [], f"{keep}: {waits}"
            np.testing.assert_allclose(binding.copy_outputs_to_cpu()[0], expected(x, ops), rtol=1e-6, atol=1e-5)
        if capture:
            assert session.device_graph_status() == "replaying"
    session.close()


class SlotHooksOnlyCUDAExecutionProvider(CUDAExecutionProvider):
    """The CUDA provider without its owner-scoped graph hooks, so the session's tokens go through the contract's
    defaults to the slot hooks, as on a one-graph provider."""

    @ort.hookimpl
    def name(self):
        return "SlotHooksOnlyCUDAExecutionProvider"

    @ort.hookimpl
    def short_name(self):
        return "cuda-slot-hooks"


for _hook in ("begin_owned_device_graph_capture", "end_owned_device_graph_capture", "abort_owned_device_graph_capture",
              "replay_owned_device_graph", "replay_owned_device_graph_segment", "reset_owned_device_graph",
              "retire_owned_device_graphs", "has_owned_device_graph"):
    setattr(SlotHooksOnlyCUDAExecutionProvider, _hook, None)  # not callable: hides the inherited hook


def test_signatures_on_the_slot_hooks_each_capture_a_graph_of_their_own():
    """The CUDA slot hooks extend an installed graph with the next segment; the defaults reset the slot before a
    fresh capture, so the [5] capture does not become a second segment of the [3] graph, and [3] after [5]
    captures again rather than replaying anything of [5]'s."""
    name = SlotHooksOnlyCUDAExecutionProvider.__name__
    ort.register_provider(SlotHooksOnlyCUDAExecutionProvider)
    try:
        ops = ("Axpb", "Axpb")
        session = capture_session(axpb_model(ops), providers=(name,))
        provider = session.provider_handle(name).provider
        assert not session.provider_handle(name).implements("has_owned_device_graph")
        rng = np.random.default_rng(5)
        runner = session._executor.graphs
        for rows in (3, 3, 3, 5, 5, 5, 3, 3, 3):
            x = rng.standard_normal((rows, 8)).astype(np.float32)
            (y,) = session.run(None, {"x": x})
            np.testing.assert_allclose(y, expected(x, ops), rtol=1e-6, atol=1e-5)
            slot_token = provider._slot_tokens.get(PRIMARY)
            if slot_token is not None and provider.device_graphs().has(slot_token):
                assert provider.device_graphs().segment_count(slot_token) == 1
        assert session.device_graph_status() == "replaying"
        assert runner.captures == 3
        session.close()
    finally:
        ort.unregister_provider(name)


def test_verify_steps_keep_their_own_graph_beside_the_decode_step():
    """On a provider with one graph per slot (the slot hooks through the defaults), decode steps (1 row) and
    verification steps (4 rows) in one slot evict each other's graph at every alternation; with the verification
    steps in the VERIFY slot both graphs stay installed and every run replays."""
    name = SlotHooksOnlyCUDAExecutionProvider.__name__
    ort.register_provider(SlotHooksOnlyCUDAExecutionProvider)
    try:
        ops = ("Axpb", "Axpb")
        verify = ort.RunOptions()
        verify.add_run_config_entry("device_graph.slot", "verify")
        rng = np.random.default_rng(6)
        captures = {}
        for use_slot in (False, True):
            session = capture_session(axpb_model(ops), providers=(name,))
            for _ in range(5):
                for rows, options in ((1, None), (4, verify if use_slot else None)):
                    x = rng.standard_normal((rows, 8)).astype(np.float32)
                    (y,) = session.run(None, {"x": x}, options)
                    np.testing.assert_allclose(y, expected(x, ops), rtol=1e-6, atol=1e-5)
            captures[use_slot] = session._executor.graphs.counts["captures"]
            assert session.device_graph_status() == "replaying" or not use_slot
            session.close()
        assert captures == {False: 4, True: 2}, captures
    finally:
        ort.unregister_provider(name)


def decode_model() -> bytes:
    """y = Axpb(x + Gather(table, ids)) with alpha 0.5: a step whose Gather validates its index on the device."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [5, 8], np.linspace(-1, 1, 40, dtype=np.float32).tolist())
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], name="gather"),
             helper.make_node("Add", ["x", "rows"], ["s"], name="add"),
             helper.make_node("Axpb", ["s"], ["y"], name="scale", domain=DOMAIN, alpha=0.5, beta=0.0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8]),
                                           helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], initializer=[table])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


def test_a_replayed_decode_step_neither_synchronizes_nor_transfers(monkeypatch):
    """An io_binding loop whose state stays on the device: each step feeds the previous step's output back
    (device to device) and replays; the driver sees no synchronization and no host transfer until the caller
    reads the result, although the step's Gather validates on the device (its flags are read with the result:
    before, every run read them back, a transfer and a synchronization per step)."""
    session = capture_session(decode_model())
    handle = session.provider_handle("cuda")
    table = np.linspace(-1, 1, 40, dtype=np.float32).reshape(5, 8).astype(np.float64)
    state = ort.Tensor.from_numpy(np.full((1, 8), 0.5, np.float32), provider=handle)
    ids = ort.Tensor.from_numpy(np.array([3], np.int64), provider=handle)
    out = ort.Tensor.zeros(ort.DataType.FLOAT, (1, 8), provider=handle)
    binding = session.io_binding()
    binding.bind_ortvalue_input("x", ort.OrtValue(state))
    binding.bind_ortvalue_input("ids", ort.OrtValue(ids))
    binding.bind_output("y", "cuda", 0, np.float32, [1, 8], out.device_ptr)
    counting = CountingDriver(handle.provider.cuda_device().driver)
    monkeypatch.setattr(handle.provider.cuda_device(), "driver", counting)
    x = np.full((1, 8), 0.5, np.float64)
    per_step = []
    for step in range(6):
        counting.calls.clear()
        session.run_with_iobinding(binding)
        handle.hook.copy_device_to_device(src=out.buffer, src_offset=0, dst=state.buffer, dst_offset=0,
                                          nbytes=out.nbytes)  # the next step's input, on the stream
        x = 0.5 * (x + table[3])
        per_step.append((counting.syncs(), counting.host_transfers(), dict(counting.calls)))
        if step >= 2:
            assert session.device_graph_status() == "replaying"
    for syncs, transfers, calls in per_step[2:]:
        assert (syncs, transfers) == (0, 0), calls
        assert calls.get("cuGraphLaunch") == 1
        # The output goes from the graph's buffer straight into the bound one (no temporary copy), then back
        # into the state: two device copies, no allocation.
        assert calls.get("cuMemcpyDtoDAsync") == 2 and "cuMemAllocAsync" not in calls, calls
    counting.calls.clear()
    (y,) = binding.copy_outputs_to_cpu()  # the one read the caller chooses, and the validation word's
    assert counting.host_transfers() == 2
    np.testing.assert_allclose(y, x, rtol=1e-6)
    session.close()


def gather_model() -> bytes:
    """y = Axpb(Gather(table, ids)): a device kernel that validates its indices, then one that does not."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [5, 8], np.arange(40, dtype=np.float32).tolist())
    nodes = [helper.make_node("Gather", ["table", "ids"], ["rows"], name="gather"),
             helper.make_node("Axpb", ["rows"], ["y"], name="scale", domain=DOMAIN, alpha=2.0, beta=0.0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 8])], initializer=[table])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()


@pytest.mark.parametrize("capture", [False, True])
def test_validation_of_a_device_resident_run_waits_for_the_next_host_read(capture):
    """The flags of a run whose outputs stay on the device are read at the next host-visible read (or before the
    next run opens its own), not inside run_with_iobinding; an error is raised there, typed and naming the nodes,
    and never dropped."""
    session = capture_session(gather_model(), capture=capture)
    handle = session.provider_handle("cuda")
    ids = ort.Tensor.from_numpy(np.array([1, 3], np.int64), provider=handle)
    binding = session.io_binding()
    binding.bind_ortvalue_input("ids", ort.OrtValue(ids))
    binding.bind_output("y", "cuda", 0)
    table = np.arange(40, dtype=np.float32).reshape(5, 8)
    for _ in range(3):
        session.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], 2 * table[[1, 3]])
    handle.copy_from_host(np.array([1, 99], np.int64), ids.buffer)  # out of range
    session.run_with_iobinding(binding)  # nothing read back: no error yet
    with pytest.raises(ort.errors.DeviceValidationError, match=r"flags=0x1.*'gather' \(Gather\)"):
        binding.copy_outputs_to_cpu()
    binding.copy_outputs_to_cpu()  # consumed once
    session.run_with_iobinding(binding)  # still out of range
    handle.copy_from_host(np.array([2, 2], np.int64), ids.buffer)
    session.run_with_iobinding(binding)  # a valid run joins the open submission: the earlier flags stay
    with pytest.raises(ort.errors.DeviceValidationError, match="flags=0x1"):
        binding.copy_outputs_to_cpu()
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], 2 * table[[2, 2]])
    handle.copy_from_host(np.array([7, 0], np.int64), ids.buffer)
    session.run_with_iobinding(binding)
    with pytest.raises(ort.errors.DeviceValidationError, match="flags=0x1"):  # a run reading to the host
        session.run(None, {"ids": np.array([0, 1], np.int64)})
    handle.copy_from_host(np.array([4, 0], np.int64), ids.buffer)
    session.run_with_iobinding(binding)
    binding.synchronize_outputs()
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], 2 * table[[4, 0]])
    session.close()


@pytest.fixture
def trimming_host_provider():
    """A host provider whose Trim keeps all rows of x when their sum is not negative, else the first row only: a
    shape that depends on data, behind an annotation that says otherwise."""

    class TrimmingHostExecutionProvider:
        @ort.hookimpl
        def name(self):
            return "TrimmingHostExecutionProvider"

        @ort.hookimpl
        def supports_op(self, node):
            if node.domain == "test.host":
                return ort.KernelMatch.supported(cost=1.0)
            return ort.KernelMatch.unsupported("runs only test.host operators")

        @ort.hookimpl
        def get_kernel(self, node):
            return lambda x: ((x if x.sum() >= 0 else x[:1]).copy(),)

    ort.register_provider(TrimmingHostExecutionProvider)
    yield "TrimmingHostExecutionProvider"
    ort.unregister_provider("TrimmingHostExecutionProvider")


def test_a_seam_whose_shape_changes_under_a_captured_graph_runs_eagerly(trimming_host_provider):
    """The segment after the seam recorded the seam value's buffer at its captured shape: a run where the seam
    gives another shape is never replayed over it (a silent wrong result), but runs eagerly, as its signature
    does from then on."""
    nodes = [helper.make_node("Axpb", ["x"], ["t0"], name="n0", domain=DOMAIN, alpha=2.0, beta=0.0),
             helper.make_node("Trim", ["t0"], ["t1"], name="n1", domain="test.host"),
             helper.make_node("Axpb", ["t1"], ["y"], name="n2", domain=DOMAIN, alpha=3.0, beta=1.0)]
    vi = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 8]) for n in ("t0", "t1")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], value_info=vi)
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1), helper.make_opsetid("test.host", 1)]
    model = helper.make_model(graph, opset_imports=opsets, ir_version=9).SerializeToString()
    session = capture_session(model, providers=(CUDA, trimming_host_provider))
    positive = np.ones((2, 8), np.float32)
    for _ in range(3):
        (y,) = session.run(None, {"x": positive})
        np.testing.assert_array_equal(y, 3 * (2 * positive) + 1)
    assert session.device_graph_status().startswith("replaying 2 graph segments")
    negative = -np.arange(16, dtype=np.float32).reshape(2, 8)
    for _ in range(2):
        (y,) = session.run(None, {"x": negative})
        np.testing.assert_array_equal(y, 3 * (2 * negative[:1]) + 1)
        assert session.device_graph_status() == (
            "eager: node 'n1' (Trim) gave tensor(float) [1, 8] where the captured graph reads tensor(float) [2, 8] "
            "(a shape that depends on data): these feed shapes run eagerly"), session.device_graph_status()
    (y,) = session.run(None, {"x": positive})
    np.testing.assert_array_equal(y, 3 * (2 * positive) + 1)
    _check_leaks(session)


def test_a_deferred_submission_a_recipient_settled_is_not_joined():
    """A recipient (a DeviceIoBinding's, say) that reads the open submission settles it; the next deferred run
    then opens a new submission instead of joining the finished one, and no flag is lost."""
    session = capture_session(gather_model())
    handle = session.provider_handle("cuda")
    recipient = handle.hook.register_device_validation_owner()
    tokens = []

    class AddRecipient:
        @ort.hookimpl(wrapper=True)
        def begin_device_validation(self, registration):
            token = yield
            tokens.append(handle.hook.add_device_validation_recipient(submission=token, recipient=recipient))
            return token

    plugin = AddRecipient()
    handle.pm.register(plugin, name="test-recipient")
    try:
        ids = ort.Tensor.from_numpy(np.array([2, 3], np.int64), provider=handle)
        binding = session.io_binding()
        binding.bind_ortvalue_input("ids", ort.OrtValue(ids))
        binding.bind_output("y", "cuda", 0)
        session.run_with_iobinding(binding)
        assert handle.hook.consume_device_validation_error(registration=recipient, token=tokens[-1]) == 0
        session.run_with_iobinding(binding)  # a new submission, not the finished one
        handle.copy_from_host(np.array([1, 99], np.int64), ids.buffer)
        session.run_with_iobinding(binding)
        assert handle.hook.consume_device_validation_error(registration=recipient, token=tokens[-1]) == 1
        handle.copy_from_host(np.array([0, 1], np.int64), ids.buffer)
        with pytest.raises(ort.errors.DeviceValidationError, match="flags=0x1"):  # the earlier run's, still
            session.run_with_iobinding(binding)
        session.run_with_iobinding(binding)
        table = np.arange(40, dtype=np.float32).reshape(5, 8)
        np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], 2 * table[[0, 1]])
    finally:
        handle.pm.unregister(plugin)
        handle.hook.unregister_device_validation_owner(registration=recipient)
        session.close()
