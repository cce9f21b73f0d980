"""Statically quantized CNNs outside the zoo against onnxruntime (issue 20): onnx's light ResNet-50, Inception v1 and
SqueezeNet (the backend test data's, weights written as ConstantOfShape) given random weights, version-converted
to opset 13 and quantized the way users do it with onnxruntime's tools (quant_pre_process, then quantize_static
in QDQ format, uint8 activations, int8 weights, four random calibration inputs). Steady state in one process,
ours / onnxruntime by the best of blocks of calls (bench_timing.in_blocks), each runtime on the same thread count;
``--busy N`` times them beside N CPU-bound processes (zoo_bench.Competitors).

    .venv/bin/python benchmarks/qdq_cnns.py [--threads 1,2] [--models resnet50,inception_v1,squeezenet] [--busy 1]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper, version_converter

MODELS = ("resnet50", "inception_v1", "squeezenet")


def _light(name: str) -> onnx.ModelProto:
    """The light model with its ConstantOfShape weights as random initializers (He-scaled; 1-D ones, the batch
    norms' parameters, in [0.5, 1)), the unused inputs dropped, at opset 13."""
    model = onnx.load(os.path.join(os.path.dirname(onnx.__file__), "backend/test/data/light", f"light_{name}.onnx"))
    graph, rng = model.graph, np.random.default_rng(0)
    shapes = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in graph.node if n.op_type == "Constant"}
    shapes.update({i.name: numpy_helper.to_array(i) for i in graph.initializer})
    kept = []
    for node in graph.node:
        shape = shapes.get(node.input[0]) if node.op_type == "ConstantOfShape" and node.input else None
        if shape is None:
            kept.append(node)
            continue
        fan = int(np.prod(shape[1:])) if len(shape) > 1 else 1
        value = rng.standard_normal(shape) * np.sqrt(2.0 / max(fan, 1)) if len(shape) > 1 \
            else rng.uniform(0.5, 1.0, shape)
        graph.initializer.append(numpy_helper.from_array(value.astype(np.float32), node.output[0]))
    used = {name for node in kept for name in node.input}
    kept = [n for n in kept if not (n.op_type == "Constant" and n.output[0] not in used)]
    del graph.node[:]
    graph.node.extend(kept)
    initialized = {i.name for i in graph.initializer}
    inputs = [i for i in graph.input if i.name in used and i.name not in initialized]
    del graph.input[:]
    graph.input.extend(inputs)
    model.ir_version = 7
    return version_converter.convert_version(model, 13)


def quantized(name: str, folder: Path) -> Path:
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    from onnxruntime.quantization.shape_inference import quant_pre_process

    target = folder / f"light_{name}.int8_qdq.onnx"
    if target.exists():
        return target
    model = _light(name)
    plain, prepared = folder / f"light_{name}.fp32.onnx", folder / f"light_{name}.pre.onnx"
    onnx.save(model, plain)
    quant_pre_process(str(plain), str(prepared))
    feed = model.graph.input[0]
    shape = [d.dim_value or 1 for d in feed.type.tensor_type.shape.dim]
    rng = np.random.default_rng(1)

    class Calibration(CalibrationDataReader):
        def __init__(self):
            self.left = 4

        def get_next(self):
            self.left -= 1
            return {feed.name: rng.standard_normal(shape).astype(np.float32)} if self.left >= 0 else None

    quantize_static(str(prepared), str(target), Calibration(), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return target


BLOCK, PAUSE = 5, 0.1  # calls a block, seconds before each (bench_timing.in_blocks: the other runtime's pool idle)


def compare(path: Path, threads: int, rounds: int = 5) -> tuple[float, float]:
    """(ours, onnxruntime): seconds a call, the best of ``rounds`` blocks each, the runtimes taking turns."""
    import onnx_runtime
    import onnxruntime
    from bench_timing import in_blocks

    theirs_options = onnxruntime.SessionOptions()
    theirs_options.intra_op_num_threads, theirs_options.log_severity_level = threads, 3
    ours_options = onnx_runtime.SessionOptions()
    ours_options.intra_op_num_threads = threads
    theirs = onnxruntime.InferenceSession(str(path), theirs_options, providers=["CPUExecutionProvider"])
    ours = onnx_runtime.InferenceSession(str(path), ours_options, providers=["CPUExecutionProvider"])
    feed = theirs.get_inputs()[0]
    x = np.random.default_rng(2).standard_normal([d if isinstance(d, int) else 1 for d in feed.shape])
    feeds = {feed.name: x.astype(np.float32)}
    times = in_blocks({"ours": lambda: ours.run(None, feeds), "ort": lambda: theirs.run(None, feeds)},
                      rounds * BLOCK, block=BLOCK, pause=PAUSE)

    def best(samples: list[float]) -> float:
        return min(statistics.fmean(samples[i:i + BLOCK]) for i in range(0, len(samples), BLOCK))

    return best(times["ours"]), best(times["ort"])


def main() -> None:
    os.environ.setdefault("ONNX_RUNTIME_COMPILE_IN_BACKGROUND", "0")  # steady state: compiled loops from the start
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--folder", type=Path, default=Path(tempfile.gettempdir()) / "onnx_runtime_qdq_cnns")
    parser.add_argument("--busy", type=int, default=0, help="competing CPU-bound processes during the timing")
    args = parser.parse_args()
    args.folder.mkdir(parents=True, exist_ok=True)
    from zoo_bench import Competitors

    for name in args.models.split(","):
        path = quantized(name, args.folder)
        for threads in (int(t) for t in args.threads.split(",")):
            with Competitors(args.busy) if args.busy else contextlib.nullcontext():
                ours, theirs = compare(path, threads)
            print(f"light_{name}.int8_qdq threads {threads}{' busy' if args.busy else ''}: ours {ours * 1e3:.2f} ms, "
                  f"onnxruntime {theirs * 1e3:.2f} ms, ratio {ours / theirs:.2f}", flush=True)


if __name__ == "__main__":
    main()
