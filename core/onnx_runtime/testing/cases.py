"""The onnx package's backend test cases, run through onnx_runtime on one provider under test.

Node cases (``onnx.backend.test.case.node.collect_testcases()``) and the model-level sets shipped in the onnx
wheel (``backend/test/data/{simple,pytorch-converted,pytorch-operator}``) are compared as onnx's own backend
runner compares them: each case's rtol/atol for floats; exact for integers, bools and strings; sequences element
by element; None for empty optionals. A case whose nodes the provider declines is :class:`Declined` (a skip with
the provider's reasons, not a failure); a node the provider accepted that runs elsewhere is a
:class:`SilentFallback` (a failure).
"""

from __future__ import annotations

import functools
import glob
import json
import os
import tempfile
import warnings

import numpy as np
import onnx
from onnx import numpy_helper

from ..errors import UnsupportedOperatorError

# onnx's own runner compares the model-level sets with these tolerances.
MODEL_SET_RTOL, MODEL_SET_ATOL = 1e-3, 1e-7
MODEL_SET_KINDS = ("simple", "pytorch-converted", "pytorch-operator")


class Declined(Exception):
    """The provider under test declined nodes of a case: ``reasons`` maps ``"node (Op)"`` to its reason."""

    def __init__(self, provider: str, reasons: dict[str, str]):
        self.provider, self.reasons = provider, reasons
        detail = "; ".join(f"{node}: {reason}" for node, reason in reasons.items())
        super().__init__(f"declined by {provider}: {detail}")


class SilentFallback(AssertionError):
    """A node the provider under test accepted ran on another provider."""


@functools.cache
def node_cases() -> dict:
    """Every backend node case of the installed onnx, by name."""
    from onnx.backend.test.case.node import collect_testcases

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the case generators trip numpy overflow warnings on purpose
        return {case.name: case for case in collect_testcases()}


def model_set_dirs() -> dict[str, str]:
    """``kind/name`` -> folder, for every model-level set shipped in the onnx wheel."""
    root = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
    found = {}
    for kind in MODEL_SET_KINDS:
        for folder in sorted(glob.glob(os.path.join(root, kind, "*"))):
            if os.path.isdir(folder):
                found[f"{kind}/{os.path.basename(folder)}"] = folder
    return found


def read_listing(path: str) -> dict[str, str]:
    """``NAME REASON`` lines (``#`` comments and blank lines ignored): name -> reason."""
    found = {}
    with open(path) as handle:
        for line in handle:
            line = line.strip()
            if line and not line.startswith("#"):
                name, _, reason = line.partition(" ")
                found[name] = reason.strip()
    return found


def read_pb(path: str):
    """A test-data .pb file: (name, value) of a TensorProto, a SequenceProto, or an OptionalProto."""
    with open(path, "rb") as handle:
        data = handle.read()
    for proto_type, convert in (
        (onnx.TensorProto, numpy_helper.to_array),
        (onnx.SequenceProto, numpy_helper.to_list),
        (onnx.OptionalProto, numpy_helper.to_optional),
    ):
        proto = proto_type()
        try:
            proto.ParseFromString(data)
        except Exception:
            continue
        if proto_type is onnx.TensorProto and not proto.HasField("data_type") and proto.data_type == 0:
            continue
        return proto.name, convert(proto)
    raise ValueError(f"{path} is not a tensor, sequence or optional")


def _numbered(folder: str, prefix: str) -> list[str]:
    paths = glob.glob(os.path.join(folder, f"{prefix}_*.pb"))
    return sorted(paths, key=lambda p: int(p.rsplit("_", 1)[1][:-3]))


def load_model_set(model_dir: str):
    """(model path, [(inputs, outputs)]) for one folder of the model-level sets."""
    sets = []
    for data_dir in sorted(glob.glob(os.path.join(model_dir, "test_data_set_*"))):
        inputs = [read_pb(p)[1] for p in _numbered(data_dir, "input")]
        outputs = [read_pb(p)[1] for p in _numbered(data_dir, "output")]
        sets.append((inputs, outputs))
    return os.path.join(model_dir, "model.onnx"), sets


def normalize(value):
    """As onnx's runner does: cases may hold TensorProto objects for exotic element types."""
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else value


STRICT_KERNELS = "session.strict_kernels"  # session/strict.py: every kernel call checked against its node


def run_case(model, data_sets, rtol: float, atol: float, provider: str = "CPUExecutionProvider",
             fallback: str | None = None, provider_options: dict | None = None, strict: bool = True) -> None:
    """Run one case on ``provider`` (``fallback`` listed after it, if any) and compare every data set. With
    ``strict``, the session checks every kernel call (a tuple of the node's arity, declared dtypes and shapes,
    inputs unchanged) and a broken rule fails the case.

    Raises :class:`Declined` when the provider declines a node of the case, :class:`SilentFallback` when a node
    it accepted ran elsewhere, and AssertionError when an output differs."""
    from ..session import InferenceSession, SessionOptions

    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(model)
    source = proto.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    providers: list = [(provider, dict(provider_options or {}))]
    if fallback:
        providers.append(fallback)
    options = SessionOptions()
    if strict:
        options.add_session_config_entry(STRICT_KERNELS, "1")
    with tempfile.TemporaryDirectory(prefix="onnx_runtime_testing_") as scratch:
        # With a fallback listed, the profile's node events say which provider each node ran on.
        options.enable_profiling = bool(fallback)
        options.profile_file_prefix = os.path.join(scratch, "profile")
        try:
            session = InferenceSession(source, options, providers=providers)
        except UnsupportedOperatorError as exc:
            raise Declined(provider, {"session": str(exc)}) from None
        try:
            name = session.get_providers()[0]
            check_placement(session, name)
            initializers = {i.name for i in proto.graph.initializer}
            input_names = [vi.name for vi in proto.graph.input if vi.name not in initializers]
            for inputs, expected in data_sets:
                feeds = dict(zip(input_names, [normalize(v) for v in inputs]))
                outputs = session.run(None, feeds)
                assert_similar([normalize(v) for v in expected], outputs, rtol, atol)
            if fallback:
                check_ran_on(session, name, session.end_profiling())
        finally:
            session.close()


def check_placement(session, provider: str) -> None:
    """Declined nodes raise :class:`Declined`; a node placed elsewhere that ``provider`` never declined raises
    :class:`SilentFallback`."""
    placement = session.placement()
    declined = {f"{r.node} ({r.op_type})": r.rejected[provider] for r in placement if provider in r.rejected}
    if declined:
        raise Declined(provider, declined)
    stray = [f"{r.node} ({r.op_type}) on {r.provider}" for r in placement if r.provider != provider]
    if stray:
        raise SilentFallback(f"{provider} did not decline these nodes, yet they were placed elsewhere: "
                             + ", ".join(stray))


def check_ran_on(session, provider: str, profile_path: str) -> None:
    """Every node placed on ``provider`` that ran, ran on it (from the session's profile)."""
    with open(profile_path) as handle:
        events = [e for e in json.load(handle) if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    ran: dict[str, set] = {}
    for event in events:
        if event["args"].get("op_name") != "MemcpyToHost":
            ran.setdefault(event["name"][: -len("_kernel_time")], set()).add(event["args"].get("provider"))
    wrong = [f"{r.node} ({r.op_type}) ran on {sorted(ran[r.node])}" for r in session.placement()
             if r.provider == provider and r.node in ran and ran[r.node] != {provider}]
    if wrong:
        raise SilentFallback(f"placed on {provider}, these nodes ran elsewhere: " + ", ".join(wrong))


def assert_similar(expected, outputs, rtol: float, atol: float, where: str = "output") -> None:
    """``outputs`` equal ``expected`` as onnx's backend runner compares them."""
    assert len(outputs) == len(expected), f"{where}: {len(outputs)} values, expected {len(expected)}"
    for index, (want, got) in enumerate(zip(expected, outputs)):
        label = f"{where}[{index}]"
        if want is None:
            assert got is None, f"{label}: expected an empty optional, got {type(got).__name__}"
            continue
        if isinstance(want, (list, tuple)):
            assert isinstance(got, (list, tuple)), f"{label}: expected a sequence, got {type(got).__name__}"
            assert_similar(list(want), list(got), rtol, atol, label)
            continue
        _assert_array(np.asarray(want), got, rtol, atol, label)


def _assert_array(want: np.ndarray, got, rtol: float, atol: float, label: str) -> None:
    assert isinstance(got, np.ndarray), f"{label}: expected an array, got {type(got).__name__}"
    assert got.shape == want.shape, f"{label}: shape {got.shape}, expected {want.shape}"
    if want.dtype == object:
        np.testing.assert_array_equal(got, want, err_msg=label)
        return
    assert got.dtype == want.dtype, f"{label}: dtype {got.dtype}, expected {want.dtype}"
    if want.dtype.kind in "biu":
        np.testing.assert_array_equal(got, want, err_msg=label)
    elif want.dtype.kind in "fc":
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=label)
    else:  # ml_dtypes (bfloat16, float8, int4, float4...): compare through float32 / int, at the case's tolerance
        wide = np.float32 if "float" in want.dtype.name else np.int64
        g, w = got.astype(wide), want.astype(wide)
        if wide is np.int64:
            np.testing.assert_array_equal(g, w, err_msg=label)
        else:
            np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=label)  # type: ignore[arg-type]
