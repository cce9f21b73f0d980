"""Driver calls per step between CUDA sessions, on the simulator: host synchronizations, event waits, host
transfers and graph launches, counted from the driver (never timed).

Scenarios (two small float32 models, 4x16):
  decode      one session's bound step replayed: state and output in DeviceIoBindings, an epilogue that copies
              the output into a scratch binding captured with it; nothing crosses to the host.
  hand-over   session A writes its DeviceIoBinding output (an uploaded feed), session B reads it in place through
              IO binding with its output kept on the device; B eager, then B capturing.
  scratch     the decode step of session B replayed while session A reads B's scratch after every step.
  threads     two sessions on two threads, each replaying its own device-resident step (IO binding, output kept on
              the device) and synchronizing its outputs (the provider's sync) after every step; counts per step
              of one session.

usage: ONNX_RUNTIME_CUDA_SIM=1 python benchmarks/cuda_lane_counts.py [--steps N]
"""

from __future__ import annotations

import argparse
import os

import numpy as np
from onnx import TensorProto, helper, numpy_helper

SHAPE = (4, 16)
CUDA = "CUDAExecutionProvider"


def _model(nodes, name_in: str, name_out: str, initializers: dict) -> bytes:
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(name_in, TensorProto.FLOAT, SHAPE)],
                              [helper.make_tensor_value_info(name_out, TensorProto.FLOAT, SHAPE)],
                              initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9).SerializeToString()


def producer() -> bytes:
    w = (np.random.default_rng(0).standard_normal((16, 16)) / 4).astype(np.float32)
    return _model([helper.make_node("MatMul", ["x", "w"], ["t"]), helper.make_node("Relu", ["t"], ["h"])],
                  "x", "h", {"w": w})


def consumer() -> bytes:
    b = np.linspace(-1, 1, 16, dtype=np.float32)
    return _model([helper.make_node("Add", ["h", "b"], ["s"]), helper.make_node("Tanh", ["s"], ["z"])],
                  "h", "z", {"b": b})


def session(ort, model: bytes, capture: bool):
    options = ort.SessionOptions()
    if capture:
        options.add_session_config_entry("session.graph_capture", "1")
    return ort.InferenceSession(model, options, providers=[CUDA])


def decode_step(ort, sess):
    """``sess``'s bound step with its epilogue (state -> out, out copied into scratch), and the scratch."""
    from onnx_runtime.session.device_step import StepEpilogue

    state = sess.device_io_binding(ort.DeviceBindingSpec.input("h", np.float32, SHAPE))
    out = sess.device_io_binding(ort.DeviceBindingSpec.output("z", np.float32, SHAPE))
    scratch = sess.device_io_binding(ort.DeviceBindingSpec.scratch("s", np.float32, SHAPE))
    state.write_logical(np.full(SHAPE, 0.5, np.float32))
    nbytes = scratch.nbytes
    epilogue = StepEpilogue(lambda: out.snapshot_device_into(scratch, nbytes),
                            ("copy", out.device_ptr, scratch.device_ptr, nbytes), (scratch,))

    def step():
        sess.run_with_device_bindings([state, out], output_names=[], epilogue=epilogue)
    return step, scratch, (state, out, scratch)


def reader(ort, sess, tensor):
    """A run of ``sess`` reading ``tensor`` in place, its output kept on the device."""
    handle = sess.provider_handle(CUDA)
    kept = ort.Tensor.empty(ort.DataType.FLOAT, SHAPE, handle)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("h", ort.OrtValue(tensor))
    binding.bind_ortvalue_output("z", ort.OrtValue(kept))
    return lambda: sess.run_with_iobinding(binding)


def synced_step(ort, sess):
    """``sess`` reads a device tensor and keeps its output on the device, then synchronizes its outputs."""
    handle = sess.provider_handle(CUDA)
    feed = ort.Tensor.from_numpy(np.full(SHAPE, 0.5, np.float32), provider=handle)
    binding = sess.io_binding()
    binding.bind_ortvalue_input("h", ort.OrtValue(feed))
    binding.bind_output("z", "cuda")

    def step():
        sess.run_with_iobinding(binding)
        binding.synchronize_outputs()
    return step


def on_two_threads(first, second):
    """One step that runs ``first`` and ``second`` at once on two threads (each counts as one session step)."""
    import threading

    def step():
        barrier = threading.Barrier(2)

        def work(run):
            barrier.wait()
            run()
        workers = [threading.Thread(target=work, args=(run,)) for run in (first, second)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    return step


def measure(device, step, steps: int, warm: int = 3, per: int = 1) -> dict[str, float]:
    for _ in range(warm):
        step()
    from onnx_runtime_ep_cuda.driver_counts import CountingDriver

    plain = device.driver
    counting = CountingDriver(plain)
    device.driver = counting
    try:
        for _ in range(steps):
            step()
    finally:
        device.driver = plain
    return {k: v / (steps * per) for k, v in counting.summary().items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.environ.setdefault("ONNX_RUNTIME_CUDA_SIM", "1")
    import onnx_runtime as ort

    rows = []
    b = session(ort, consumer(), True)
    device = b.provider_handle(CUDA).provider.cuda_device().shared
    step, _scratch, _keep = decode_step(ort, b)
    rows.append(("decode (replayed step, one session)", measure(device, step, args.steps), b.device_graph_status()))

    for capture in (False, True):
        a, b = session(ort, producer(), False), session(ort, consumer(), capture)
        kept = a.device_io_binding(ort.DeviceBindingSpec.output("h", np.float32, SHAPE))
        x = np.random.default_rng(1).standard_normal(SHAPE).astype(np.float32)
        view = ort.Tensor(ort.DataType.FLOAT, SHAPE, kept.buffer.alias(0, kept.nbytes), kept.allocator)
        read = reader(ort, b, view)

        def hand_over(a=a, kept=kept, x=x, read=read):
            a.run_with_device_bindings([kept], input_feed={"x": x}, output_names=[])
            read()
        label = f"hand-over A -> B (B {'capturing' if capture else 'eager'})"
        rows.append((label, measure(device, hand_over, args.steps), b.device_graph_status()))

    a, b = session(ort, consumer(), False), session(ort, consumer(), True)
    step, scratch, _keep2 = decode_step(ort, b)
    read = reader(ort, a, ort.Tensor(ort.DataType.FLOAT, SHAPE, scratch.buffer.alias(0, scratch.nbytes),
                                     scratch.allocator))

    def with_reader():
        step()
        read()
    rows.append(("scratch (B replayed, A reads B's scratch)", measure(device, with_reader, args.steps),
                 b.device_graph_status()))
    first, second = session(ort, consumer(), True), session(ort, consumer(), True)
    rows.append(("threads (2 sessions, each syncs its outputs)",
                 measure(device, on_two_threads(synced_step(ort, first), synced_step(ort, second)), args.steps,
                         per=2), second.device_graph_status()))
    device.sync()
    print(f"{'scenario':44} {'syncs':>6} {'waits':>6} {'xfers':>6} {'graphs':>6}  status "
          f"(per step, {args.steps} steps)")
    for label, counts, status in rows:
        print(f"{label:44} {counts['syncs']:6.2f} {counts['waits']:6.2f} {counts['transfers']:6.2f} "
              f"{counts['launches']:6.2f}  {status}")


if __name__ == "__main__":
    main()
