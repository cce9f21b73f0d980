"""Compiling ahead (``onnx-runtime compile``): run models once so that providers compile and cache
their kernels before the first session that needs them.

Providers compile kernels on first use (the CPU provider's numba loops, the CUDA provider's NVRTC
sources) and keep them in a disk cache, so the very first process after an install pays the compile
time inside its first ``run``. Running the models a deployment will serve, or without any the
default corpus (onnx's nine shipped light CNNs and a transformer block as a prefill and as a decode
step with past), moves that cost to install time. Each model runs at two signatures, its free
dimensions at 1 and at 16, because kernels choose paths by size (a decode step's one row, a
prefill's many).

It also writes the Python bytecode of onnx_runtime and of every installed provider's package: a process
that may not write ``__pycache__`` (a read-only install, ``PYTHONDONTWRITEBYTECODE``) otherwise compiles
their sources again at every import.

The models are shared among worker processes (the caches are files, which every later process
reads); a last pass in this process runs every model again from the caches, which both checks that
they load and recompiles whatever a concurrent writer lost.
"""

from __future__ import annotations

import compileall
import concurrent.futures
import importlib.util
import multiprocessing
import os
import time
from dataclasses import dataclass
from importlib.metadata import entry_points

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FREE_DIM_SIZES = (1, 16)
BACKGROUND_COMPILE_ENV = "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"
_LIGHT_CNNS = ("bvlc_alexnet", "densenet121", "inception_v1", "inception_v2", "resnet50",
               "shufflenet", "squeezenet", "vgg19", "zfnet512")


@dataclass
class Compiled:
    """One model's pass: its name, the seconds it took, and the error that stopped it (or None)."""

    name: str
    seconds: float
    error: str | None = None


def _light_cnns() -> list[tuple[str, str]]:
    folder = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "light")
    paths = [(name, os.path.join(folder, f"light_{name}.onnx")) for name in _LIGHT_CNNS]
    return [(name, path) for name, path in paths if os.path.isfile(path)]


def transformer_block(past: bool, hidden: int = 64, heads: int = 4) -> onnx.ModelProto:
    """One pre-norm decoder block as torch's TorchScript exporter spells it (LayerNormalization,
    MatMul + bias, head split by Reshape/Transpose, scaled scores, Softmax, exact GELU from Erf),
    with past keys and values concatenated in front when ``past``; batch, sequence and past length
    are free dimensions."""
    rng = np.random.default_rng(0)
    head = hidden // heads
    inits: list[TensorProto] = []
    nodes: list[onnx.NodeProto] = []

    def const(name: str, value) -> str:
        inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(name: str, shape: tuple[int, ...]) -> str:
        return const(name, (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32))

    def node(op: str, inputs: list[str], output: str, **attrs) -> str:
        nodes.append(helper.make_node(op, inputs, [output], **attrs))
        return output

    def linear(x: str, name: str, n_in: int, n_out: int) -> str:
        y = node("MatMul", [x, weight(f"{name}.w", (n_in, n_out))], f"{name}.mm")
        return node("Add", [y, const(f"{name}.b", np.zeros(n_out, np.float32))], f"{name}.out")

    def norm(x: str, name: str) -> str:
        return node("LayerNormalization", [x, const(f"{name}.g", np.ones(hidden, np.float32)),
                                           const(f"{name}.beta", np.zeros(hidden, np.float32))], f"{name}.out",
                    axis=-1, epsilon=1e-5)

    split_shape = const("split_shape", np.array([0, 0, heads, head], np.int64))
    merge_shape = const("merge_shape", np.array([0, 0, hidden], np.int64))

    def heads_of(x: str, name: str, perm: list[int]) -> str:
        return node("Transpose", [node("Reshape", [x, split_shape], f"{name}.split")], f"{name}.heads", perm=perm)

    h = norm("x", "ln1")
    q = heads_of(linear(h, "q", hidden, hidden), "q", [0, 2, 1, 3])
    k = heads_of(linear(h, "k", hidden, hidden), "k", [0, 2, 1, 3])
    v = heads_of(linear(h, "v", hidden, hidden), "v", [0, 2, 1, 3])
    if past:
        k = node("Concat", ["past_key", k], "present_key", axis=2)
        v = node("Concat", ["past_value", v], "present_value", axis=2)
    kt = node("Transpose", [k], "k.t", perm=[0, 1, 3, 2])
    scores = node("Div", [node("MatMul", [q, kt], "scores.raw"), const("scale", np.float32(np.sqrt(head)))],
                  "scores")
    context = node("MatMul", [node("Softmax", [scores], "probs", axis=-1), v], "context")
    merged = node("Reshape", [node("Transpose", [context], "context.t", perm=[0, 2, 1, 3]), merge_shape], "merged")
    x1 = node("Add", ["x", linear(merged, "o", hidden, hidden)], "x1")
    up = linear(norm(x1, "ln2"), "up", hidden, 4 * hidden)
    erf = node("Erf", [node("Div", [up, const("sqrt2", np.float32(np.sqrt(2.0)))], "gelu.div")], "gelu.erf")
    one_plus = node("Add", [erf, const("one", np.float32(1.0))], "gelu.add")
    gelu = node("Mul", [node("Mul", [up, one_plus], "gelu.mul"), const("half", np.float32(0.5))], "gelu")
    node("Add", [x1, linear(gelu, "down", 4 * hidden, hidden)], "y")

    def tensor(name: str, dims: list) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, dims)

    inputs = [tensor("x", ["batch", "sequence", hidden])]
    outputs = [tensor("y", ["batch", "sequence", hidden])]
    if past:
        cache = ["batch", heads, "past", head]
        inputs += [tensor("past_key", cache), tensor("past_value", cache)]
        outputs += [tensor("present_key", ["batch", heads, "total", head]),
                    tensor("present_value", ["batch", heads, "total", head])]
    graph = helper.make_graph(nodes, "decoder_step" if past else "decoder_prefill", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_operatorsetid("", 17)])


def default_corpus() -> list[tuple[str, str | bytes]]:
    """(name, path or serialized model) of what ``onnx-runtime compile`` runs without models."""
    blocks = [(name, transformer_block(past).SerializeToString())
              for name, past in (("decoder_prefill", False), ("decoder_step", True))]
    return _light_cnns() + blocks


def _feeds(sess, size: int) -> dict[str, np.ndarray]:
    from .dtypes import DataType

    feeds = {}
    for arg in sess.get_inputs():
        dtype = DataType.parse(arg.type).numpy
        shape = [d if isinstance(d, int) else size for d in arg.shape]
        feeds[arg.name] = np.random.default_rng(0).standard_normal(shape).astype(dtype) \
            if np.issubdtype(dtype, np.floating) else np.zeros(shape, dtype=dtype)
    return feeds


def run_model(name: str, model: str | bytes, providers: list[str] | None) -> Compiled:
    """Create a session for ``model`` and run it at every size of ``FREE_DIM_SIZES``."""
    from .session import InferenceSession

    start = time.perf_counter()
    try:
        sess = InferenceSession(model, providers=providers)
        fixed = all(isinstance(d, int) for arg in sess.get_inputs() for d in arg.shape)
        for size in FREE_DIM_SIZES[:1] if fixed else FREE_DIM_SIZES:
            sess.run(None, _feeds(sess, size))
    except Exception as exc:  # one model's failure must not stop the others from compiling
        return Compiled(name, time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    return Compiled(name, time.perf_counter() - start)


def package_folders() -> list[str]:
    """The folders of onnx_runtime and of each package an ``onnx_runtime.providers`` entry point names."""
    from .discovery import ENTRY_POINT_GROUP

    folders = [os.path.dirname(os.path.abspath(__file__))]
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            spec = importlib.util.find_spec(ep.value.split(":")[0].split(".")[0])
        except (ImportError, ValueError):
            continue  # a broken plugin: discovery reports it
        for folder in (spec.submodule_search_locations or []) if spec is not None else []:
            if folder not in folders:
                folders.append(folder)
    return folders


def compile_bytecode() -> bool:
    """Writes the bytecode of every module in ``package_folders()``; whether all of it compiled."""
    return all(compileall.compile_dir(folder, quiet=2) for folder in package_folders())


def compile_ahead(models: list[tuple[str, str | bytes]], providers: list[str] | None = None,
                  jobs: int = 1, report=None) -> list[Compiled]:
    """Run ``models`` in ``jobs`` worker processes (spawned: a forked numba or CUDA state is not
    safe), then once more each in this process from the caches; returns this process's passes.
    ``report`` is called with each worker pass as it finishes."""
    # Compile now what the models need: no first run served by numpy while kernels load in the background
    # (the CPU provider's default), here or in the workers, which inherit the environment; the caller's
    # environment is restored after (processes it starts later inherit the environment, not this choice).
    previous = os.environ.get(BACKGROUND_COMPILE_ENV)
    os.environ[BACKGROUND_COMPILE_ENV] = "0"
    try:
        return _compile_ahead(models, providers, jobs, report)
    finally:
        if previous is None:
            os.environ.pop(BACKGROUND_COMPILE_ENV, None)
        else:
            os.environ[BACKGROUND_COMPILE_ENV] = previous


def _compile_ahead(models, providers, jobs, report) -> list[Compiled]:
    """compile_ahead's work, with background loading off in the environment."""
    compile_bytecode()
    if jobs > 1 and len(models) > 1:
        context = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(min(jobs, len(models)), mp_context=context) as pool:
            futures = [pool.submit(run_model, name, model, providers) for name, model in models]
            for future in concurrent.futures.as_completed(futures):
                if report is not None:
                    report(future.result())
    results = []
    for name, model in models:
        result = run_model(name, model, providers)
        if report is not None:
            report(result)
        results.append(result)
    return results
