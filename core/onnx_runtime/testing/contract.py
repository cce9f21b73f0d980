"""Contract checks for the hooks a provider implements: return types, typed errors, memory balance, kernels.

Each check takes a fresh, initialized :class:`onnx_runtime.ProviderHandle` of the provider under test and raises
AssertionError naming the hook and the broken rule. A provider exception that is not an
:class:`onnx_runtime.errors.OnnxRuntimeError` fails the check it escapes from: the contract asks for typed errors.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from onnx import TensorProto, helper

from ..contract.buffers import DeviceBuffer, Fence
from ..contract.graphs import CaptureRegionShapeStatus, DeviceGraphSlot
from ..contract.hookspecs import HOOK_NAMES, ExecutionProviderSpec
from ..contract.kernels import Availability, KernelMatch
from ..devices import DeviceId, DeviceType
from ..dtypes import DataType
from ..errors import InvalidArgumentError, OnnxRuntimeError
from ..ir import Node
from ..provider_handle import ProviderHandle

UNKNOWN_OPTION = "onnx_runtime.testing.unknown_option"
# Small float32 nodes with their numpy reference: what the kernel checks run when supports_op accepts them.
SAMPLE_NODES: dict[str, tuple[int, Callable]] = {
    "Relu": (1, lambda x: np.maximum(x, np.float32(0))),
    "Add": (2, np.add),
    "Sub": (2, np.subtract),
    "Mul": (2, np.multiply),
    "MatMul": (2, np.matmul),
}


@contextlib.contextmanager
def typed_errors(hook: str):
    """Fail when provider code raises an untyped exception (AssertionErrors are the checks' own)."""
    try:
        yield
    except (OnnxRuntimeError, AssertionError):
        raise
    except Exception as exc:
        raise AssertionError(f"`{hook}` raised {type(exc).__name__}: {exc}; the contract asks for a typed error "
                             "from onnx_runtime.errors (ProviderError, InvalidArgumentError, ...)") from exc


def _node(op: str) -> Node:
    inputs = ["a", "b"][: SAMPLE_NODES[op][0]] if op in SAMPLE_NODES else ["a"]
    return Node(op, inputs, ["y"], name=f"check_{op.lower()}")


def _sample_inputs(op: str) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    shapes = [(3, 4), (4, 5)] if op == "MatMul" else [(3, 4), (3, 4)]
    return [rng.standard_normal(shape).astype(np.float32) for shape in shapes[: SAMPLE_NODES[op][0]]]


def _supports(handle: ProviderHandle, op: str, inputs: Sequence[np.ndarray]) -> KernelMatch:
    node = _node(op)
    with typed_errors("supports_op"):
        return handle.supports_op(node, 18, [x.shape for x in inputs], [DataType.FLOAT] * len(inputs),
                                  [None] * len(inputs))


def check_identity(handle: ProviderHandle, hook: str) -> None:
    with typed_errors(hook):
        value: Any = getattr(handle.hook, hook)()
    expected: type = {"name": str, "short_name": str, "device_type": DeviceType, "device_id": DeviceId,
                "availability": Availability}[hook]
    matches = isinstance(value, expected)  # kept apart: mypy would narrow value to object
    assert matches, f"`{hook}` returned {type(value).__name__}, not {expected.__name__}"
    if expected is str:
        assert value and not any(c.isspace() for c in value), f"`{hook}` returned {value!r}: give a non-empty word"
    if hook == "device_id":
        assert value.type == handle.hook.device_type(), f"`device_id` {value} is not of `device_type`"
    if hook == "availability" and not value.available:
        assert value.reason, "`availability` says unavailable without a reason: say what is missing and how to get it"


def check_initialize(handle: ProviderHandle, hook: str) -> None:
    fresh = ProviderHandle(type(handle.provider)())
    try:
        fresh.initialize({UNKNOWN_OPTION: "1"})
    except InvalidArgumentError as exc:
        assert UNKNOWN_OPTION in str(exc), f"`initialize` rejected an unknown option without naming it: {exc}"
    except Exception as exc:
        raise AssertionError(f"`initialize` rejected an unknown option with {type(exc).__name__}, not "
                             "InvalidArgumentError naming the key and the accepted ones") from exc
    else:
        fresh.shutdown()
        raise AssertionError(f"`initialize` accepted the unknown option {UNKNOWN_OPTION!r}; reject unknown keys "
                             "with InvalidArgumentError naming the accepted ones")


def check_shutdown(handle: ProviderHandle, hook: str) -> None:
    fresh = ProviderHandle(type(handle.provider)())
    with typed_errors(hook):
        fresh.initialize({})
        result = fresh.hook.shutdown()
    assert result is None, f"`shutdown` returned {type(result).__name__}, not None"


def check_supports_op(handle: ProviderHandle, hook: str) -> None:
    for op in SAMPLE_NODES:
        match = _supports(handle, op, _sample_inputs(op))
        if not match.is_supported:
            assert isinstance(match.reason, str) and match.reason, f"`supports_op` declined {op} without a reason"
    bogus = Node("NoSuchOperator", ["a"], ["y"], domain="org.onnx_runtime.testing", name="check_bogus")
    with typed_errors(hook):
        match = handle.supports_op(bogus, 1, [(2,)], [DataType.FLOAT], [None])
    assert not match.is_supported, "`supports_op` accepted an operator of an unknown domain (org.onnx_runtime.testing)"
    assert match.reason, "`supports_op` declined an unknown operator without a reason"


def _as_host(value, handle: ProviderHandle):
    return value if handle.is_host_accessible else value.numpy()


def check_get_kernel(handle: ProviderHandle, hook: str) -> None:
    """Each sample node the provider accepts: a kernel returning a tuple of one output of the reference's dtype,
    shape and values, leaving its inputs unchanged."""
    from ..tensor import Tensor

    ran = []
    for op, (_, reference) in SAMPLE_NODES.items():
        inputs = _sample_inputs(op)
        if not _supports(handle, op, inputs).is_supported:
            continue
        with typed_errors(hook):
            kernel = handle.hook.get_kernel(node=_node(op), shapes=[x.shape for x in inputs], opset=18, graph=None)
        assert callable(kernel), f"`get_kernel` for {op} returned {type(kernel).__name__}, not a callable kernel"
        copies = [x.copy() for x in inputs]
        with contextlib.ExitStack() as stack:
            args = inputs if handle.is_host_accessible else [
                stack.enter_context(Tensor.from_numpy(x, provider=handle)) for x in inputs]
            with typed_errors(f"{op} kernel"):
                outputs = kernel(*args)
            assert isinstance(outputs, tuple) and len(outputs) == 1, (
                f"the {op} kernel returned {type(outputs).__name__}"
                f"{f' of {len(outputs)}' if isinstance(outputs, tuple) else ''}, not a tuple of 1 output")
            got = np.asarray(_as_host(outputs[0], handle))
            want = reference(*inputs)
            assert got.dtype == want.dtype and got.shape == want.shape, (
                f"the {op} kernel returned {got.dtype}{list(got.shape)}, expected {want.dtype}{list(want.shape)}")
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=f"{op} kernel output")
            if not handle.is_host_accessible:
                outputs[0].close()
        for x, copy in zip(inputs, copies):
            assert np.array_equal(x, copy), f"the {op} kernel wrote into its input; a kernel must not"
        ran.append(op)
    if not ran:
        import pytest

        pytest.skip(f"{handle.name} accepts none of {sorted(SAMPLE_NODES)} on float32; the backend cases check "
                    "its kernels")


def check_host_inputs(handle: ProviderHandle, hook: str) -> None:
    for op in SAMPLE_NODES:
        with typed_errors(hook):
            value = handle.hook.host_inputs(node=_node(op), opset=18)
        assert value is None or (isinstance(value, tuple) and all(
            isinstance(i, int) and 0 <= i < len(_node(op).inputs) for i in value)), (
            f"`host_inputs` for {op} returned {value!r}: None or a tuple of input positions")


def check_claim_nodes(handle: ProviderHandle, hook: str) -> None:
    from ..loader import load_model

    x = helper.make_tensor_value_info("a", TensorProto.FLOAT, [2, 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])
    graph = helper.make_graph([helper.make_node("Relu", ["a"], ["y"], name="relu")], "claims", [x], [y])
    model = load_model(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))
    with typed_errors(hook):
        claimed = handle.hook.claim_nodes(graph=model.graph)
    assert isinstance(claimed, Iterable), f"`claim_nodes` returned {type(claimed).__name__}, not names"
    claimed = list(claimed)
    assert all(isinstance(n, str) for n in claimed), f"`claim_nodes` returned {claimed!r}: node names (str)"
    assert set(claimed) <= {"relu"}, f"`claim_nodes` claimed {claimed!r}, which are not nodes of the graph"


def check_custom_passes(handle: ProviderHandle, hook: str) -> None:
    with typed_errors(hook):
        passes = handle.hook.custom_passes()
    assert isinstance(passes, Sequence) and all(callable(p) for p in passes), (
        f"`custom_passes` returned {passes!r}: a sequence of callables pass_(graph[, owns]) -> bool")


def check_plan_capture_region(handle: ProviderHandle, hook: str) -> None:
    for inputs_ok, outputs_ok in ((True, True), (False, True), (True, False)):
        status = CaptureRegionShapeStatus(inputs_resolved=inputs_ok, outputs_resolved=outputs_ok)
        with typed_errors(hook):
            answer = handle.hook.plan_capture_region(node=_node("Relu"), shape_status=status)
        assert answer is None or isinstance(answer, str) or hasattr(answer, "reason"), (
            f"`plan_capture_region` returned {answer!r}: None, a reason string or a StructuralCaptureDecline")
        if not (inputs_ok and outputs_ok):
            assert answer is not None, "`plan_capture_region` admitted a node with an unresolved shape"


def check_memory(handle: ProviderHandle, hook: str) -> None:
    """allocate / deallocate / counts: owned buffers of the provider's device, each freed exactly once, the
    counters balanced; a double free is refused by the core."""
    from ..tensor import Tensor

    before = handle.allocation_counts()
    with typed_errors("allocate"):
        buffers = [handle.allocate(size, alignment) for size, alignment in ((1, 1), (64, 64), (1000, 256))]
    for buffer, (size, alignment) in zip(buffers, ((1, 1), (64, 64), (1000, 256))):
        assert isinstance(buffer, DeviceBuffer) and buffer.size >= size, f"`allocate({size})` returned {buffer!r}"
        assert buffer.device == handle.device_id, f"`allocate` returned a buffer of {buffer.device}, not its own"
        if handle.is_host_accessible:
            assert buffer.ptr % alignment == 0, f"`allocate` ignored alignment {alignment} (address {buffer.ptr:#x})"
    with typed_errors("deallocate"):
        for buffer in buffers:
            handle.deallocate(buffer)
    try:
        handle.deallocate(buffers[0])
    except InvalidArgumentError:
        pass
    else:
        raise AssertionError("a buffer was freed twice without an error; every buffer is freed exactly once")
    x = np.arange(24, dtype=np.float32).reshape(2, 3, 4)
    with Tensor.from_numpy(x, provider=handle) as tensor:
        assert np.array_equal(tensor.numpy(), x), "a tensor on the device does not read back what was written"
    after = handle.allocation_counts()
    if before is None or after is None:
        assert not handle.implements("device_allocation_counts"), "`device_allocation_counts` returned None"
        return
    assert after[0] - before[0] == after[1] - before[1] >= 3, (
        f"allocation counters moved from {before} to {after}: every allocation must be freed exactly once")


def check_copies(handle: ProviderHandle, hook: str) -> None:
    data = np.arange(256, dtype=np.uint8)
    with typed_errors(hook):
        src, dst = handle.allocate(256, 64), handle.allocate(256, 64)
        try:
            handle.copy_from_host(data, src)
            if hook == "copy":
                handle.hook.copy(src=src, dst=dst, size=256)
            elif hook == "copy_device_to_device":
                handle.hook.copy_device_to_device(src=src, src_offset=0, dst=dst, dst_offset=0, nbytes=256)
            elif hook == "copy_from_host_at":
                handle.hook.copy_from_host_at(src=data[:128], dst=dst, byte_offset=128)
                handle.hook.copy_from_host_at(src=data[128:], dst=dst, byte_offset=0)
            else:
                dst = src
            out = handle.download(dst, 256)
            want = np.concatenate([data[128:], data[:128]]) if hook == "copy_from_host_at" else data
            assert np.array_equal(out, want), f"`{hook}`: the bytes read back differ from the bytes written"
            if hook == "copy_from_host":
                try:
                    handle.copy_from_host(np.zeros(512, np.uint8), src)
                except OnnxRuntimeError:
                    pass
                else:
                    raise AssertionError("`copy_from_host` accepted 512 bytes into a 256-byte buffer")
        finally:
            handle.deallocate(src)
            if dst is not src:
                handle.deallocate(dst)


def check_row_copies(handle: ProviderHandle, hook: str) -> None:
    """``device_copy_rows``: four rows of 32 bytes at a pitch of 64 gathered into 32-byte rows, then a pitch
    under the row refused with a typed error."""
    data = np.arange(256, dtype=np.uint8)
    with typed_errors(hook):
        src, dst = handle.allocate(256, 64), handle.allocate(256, 64)
        try:
            handle.copy_from_host(data, src)
            handle.hook.device_copy_rows(src=src, src_offset=16, src_pitch=64, dst=dst, dst_offset=0, dst_pitch=32,
                                         row_bytes=32, rows=4)
            out = handle.download(dst, 128)
            want = np.concatenate([data[16 + 64 * row: 48 + 64 * row] for row in range(4)])
            assert np.array_equal(out, want), "`device_copy_rows`: the rows read back differ from the rows copied"
            try:
                handle.hook.device_copy_rows(src=src, src_offset=0, src_pitch=16, dst=dst, dst_offset=0,
                                             dst_pitch=32, row_bytes=32, rows=4)
            except OnnxRuntimeError:
                pass
            else:
                raise AssertionError("`device_copy_rows` accepted a source pitch under the row's length")
        finally:
            handle.deallocate(src)
            handle.deallocate(dst)


def check_counter_copies(handle: ProviderHandle, hook: str) -> None:
    """``device_copy_rows_at``: two 8-byte rows land at the row the counter names (its position word, less one);
    a counter naming a row past ``limit`` copies nothing."""
    data = np.arange(64, dtype=np.uint8)
    with typed_errors(hook):
        src, dst, counter = handle.allocate(64, 64), handle.allocate(64, 64), handle.allocate(16, 64)
        try:
            handle.copy_from_host(data, src)
            handle.copy_from_host(np.zeros(64, np.uint8), dst)
            for position in (3, 9):
                handle.copy_from_host(np.array([0, position], np.int64).view(np.uint8), counter)
                handle.hook.device_copy_rows_at(src=src, src_offset=8, src_pitch=16, dst=dst, dst_pitch=32,
                                                row_bytes=8, rows=2, counter=counter, word=1, bias=-1, dst_unit=8,
                                                limit=3)
            want = np.zeros(64, np.uint8)
            want[16:24], want[48:56] = data[8:16], data[24:32]
            assert np.array_equal(handle.download(dst, 64), want), (
                "`device_copy_rows_at`: the rows read back are not those copied to the counter's row")
        finally:
            for buffer in (src, dst, counter):
                handle.deallocate(buffer)


def check_returns(handle: ProviderHandle, hook: str) -> None:
    """A hook of no required argument whose spec names a plain return type: called, and its type checked."""
    spec = getattr(ExecutionProviderSpec, hook, None)
    if spec is None:
        return
    annotation = str(spec.__annotations__.get("return", ""))
    kwargs = {"slot": DeviceGraphSlot.PRIMARY} if "slot" in spec.__code__.co_varnames else {}
    try:
        with typed_errors(hook):
            value = getattr(handle.hook, hook)(**kwargs)
    except OnnxRuntimeError:
        return  # a typed refusal in this state (nothing captured, nothing to end) is within the contract
    types = {"str": str, "bool": bool, "int": int, "None": type(None), "Fence": Fence}
    wanted = tuple(types[t.strip()] for t in annotation.split("|") if t.strip() in types)
    if hook == "context_source_keys":
        assert isinstance(value, Sequence) and all(isinstance(k, str) for k in value), (
            f"`context_source_keys` returned {value!r}: a sequence of str")
    elif wanted:
        assert isinstance(value, wanted), f"`{hook}` returned {type(value).__name__}, the contract says {annotation}"


CHECKS: dict[str, Callable[[ProviderHandle, str], None]] = {
    **dict.fromkeys(("name", "short_name", "device_type", "device_id", "availability"), check_identity),
    "initialize": check_initialize,
    "shutdown": check_shutdown,
    "supports_op": check_supports_op,
    "get_kernel": check_get_kernel,
    "host_inputs": check_host_inputs,
    "claim_nodes": check_claim_nodes,
    "custom_passes": check_custom_passes,
    "plan_capture_region": check_plan_capture_region,
    **dict.fromkeys(("allocate", "deallocate", "device_allocation_counts"), check_memory),
    **dict.fromkeys(("copy_from_host", "copy_to_host", "copy", "copy_device_to_device", "copy_from_host_at"),
                    check_copies),
    "device_copy_rows": check_row_copies,
    "device_copy_rows_at": check_counter_copies,
}
QUERIES = ("sync", "defers_device_validation", "device_argmax_supported", "context_source_keys",
           "record_compute_fence", "reset_device_graph", "reset_device_graph_in", "has_device_graph_in")


def implemented_hooks(handle: ProviderHandle) -> list[str]:
    """The contract's hooks the provider implements itself, in the contract's order."""
    return [hook for hook in HOOK_NAMES if handle.implements(hook)]


def check_for(hook: str) -> Callable[[ProviderHandle, str], None] | None:
    """The check of ``hook``; None for a hook only a running session exercises (device graphs, validation
    generations, decoding, compiled contexts), or one this module does not know."""
    if hook in CHECKS:
        return CHECKS[hook]
    spec = getattr(ExecutionProviderSpec, hook, None)
    if hook in QUERIES or (spec is not None and spec.__code__.co_argcount == 1):
        return check_returns
    return None
