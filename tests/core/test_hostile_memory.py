"""Memory high-water of repeated session creation: a session dropped before the next is created must not be
alive beside it. Its weights and plans once hung off reference cycles, and creation pauses the collector, so
without a collection first every create/destroy cycle held two sessions at its peak (light_resnet50 over 20
cycles: 622 MB against onnxruntime's 361 MB; 350 MB with the collection). Now they are freed as the session's
last reference goes, and creation collects first only where something still holds them (session/collector.py)."""

from __future__ import annotations

import gc
import types
import weakref

import numpy as np
import pytest
from model_helpers import light_model, zoo_model
from onnx_runtime import InferenceSession
from onnx_runtime.session import collector


def test_a_dropped_session_is_collected_before_the_next_one_is_created():
    model, name, shape = light_model("light_squeezenet")
    data = model.SerializeToString()
    feed = {name: np.zeros(shape, np.float32)}
    InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feed)
    session = InferenceSession(data, providers=["CPUExecutionProvider"])
    session.run(None, feed)
    gc.collect()
    del session
    assert gc.isenabled()
    kept = InferenceSession(data, providers=["CPUExecutionProvider"])
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        gc.collect()
        cyclic = [_described(o) for o in gc.garbage if _kernel_or_plan(o)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not cyclic, f"the dropped session's kernels were still alive through the next creation: {cyclic[:10]}"
    kept.run(None, feed)


@pytest.mark.parametrize("name", ["light_squeezenet", "bert.dynamo.fp32", "llama.torchscript.fp32"])
def test_a_dropped_session_frees_its_kernels_and_weights_without_a_cyclic_collection(name):
    """No reference cycle holds a session's kernels, plans, specializer or weights, so dropping it frees them at once
    and the next creation skips the full collection (10 ms and more in a process that ran one small model): the
    convolution paths, generated step code and the specializer's callbacks reach their owners weakly or not at
    all. (Its provider handles refer to themselves through their defaults and hook table: small, and left to the
    collector's own schedule.)"""
    if name.startswith("light_"):
        model, input_name, shape = light_model(name)
        source, calls = model.SerializeToString(), [{input_name: np.zeros(shape, np.float32)}]
    else:
        entry, source = zoo_model(name)
        from zoo_feeds import make_feeds  # (benchmarks/, on the path once zoo_model found the zoo)

        calls = [make_feeds(spec) for spec in entry["calls"].values()]
    for _ in range(2):  # (the second time, with every module loaded and signature seen in this process)
        session = InferenceSession(source, providers=["CPUExecutionProvider"])
        for feed in calls:
            session.run(None, feed)
            session.run(None, feed)
        witnesses = session._witnesses  # noqa: SLF001
        assert witnesses, "a session with weights has something to witness its drop"
        gc.collect()
        gc.disable()
        try:
            del session
            alive = [ref() for ref in witnesses if ref() is not None]
            assert not alive, f"a dropped session's objects sat in reference cycles: {[type(a) for a in alive]}"
            assert collector.held_dropped_bytes() == 0
            gc.set_debug(gc.DEBUG_SAVEALL)
            gc.collect()
            cyclic = [_described(o) for o in gc.garbage if _kernel_or_plan(o)]
            assert not cyclic, f"kernels or plans of a dropped session sat in reference cycles: {cyclic[:10]}"
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
            gc.enable()


def _kernel_or_plan(value) -> bool:
    """An array, or an object or function of the CPU provider's kernels, or of the session's plans (not the compiled
    loops' process-wide objects, which the kernel loader's thread makes and drops meanwhile)."""
    module = value.__module__ if isinstance(value, types.FunctionType) else type(value).__module__
    return isinstance(value, np.ndarray) or (module or "").startswith(
        ("onnx_runtime_ep_cpu.ops", "onnx_runtime_ep_cpu.algorithms", "onnx_runtime.session"))


def _described(value) -> str:
    return getattr(value, "__qualname__", None) or type(value).__qualname__


def test_a_session_a_cycle_holds_is_collected_before_the_next_creation():
    """Where something does hold a dropped session's objects in a cycle (a list holding its largest weight and
    itself, here), the next creation still runs one full collection first."""
    model, name, shape = light_model("light_squeezenet")
    data = model.SerializeToString()
    session = InferenceSession(data, providers=["CPUExecutionProvider"])
    session.run(None, {name: np.zeros(shape, np.float32)})
    cycle: list = [collector.largest_weights(session._model.graph)[0]]  # noqa: SLF001
    cycle.append(cycle)
    held = weakref.ref(cycle[0])
    gc.collect()
    del session, cycle
    assert held() is not None  # (in its cycle)
    InferenceSession(data, providers=["CPUExecutionProvider"])
    assert held() is None, "the dropped session's cycle was still alive through the next creation"
