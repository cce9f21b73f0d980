"""Builds the model zoo: small ONNX models made the way users make them, for tests/cpu/test_zoo.py.

Each model of ``zoo_models.SPECS`` (random weights, tiny configurations) is exported with both of torch's
exporters (TorchScript: ``dynamo=False``, opset 17; ``dynamo=True``, its default opset) with dynamic batch,
sequence and past length, then turned into the variants that apply to it with onnxruntime's own tools: float16
(``convert_float_to_float16``, keep_io_types), dynamic int8 (``quantize_dynamic``), static int8 in QDQ and
QOperator formats (``quantize_static`` with a random calibration reader), the transformer optimizer's output
(``optimize_model``, com.microsoft contrib operators) and 4-bit weights (``MatMulNBitsQuantizer``, block 32).

Every file is run once in onnxruntime for each of its calls (the float32 export is also compared with torch),
and ``manifest.json`` lists every model: file, architecture, exporter, variant, tolerance class and how to make
its feeds; what failed (an export, a conversion, a call onnxruntime refuses) is listed with the reason.

    .venv-zoo/bin/python benchmarks/zoo.py --out benchmarks/.models/zoo [--models bert,gpt2] [--exporters dynamo]
    .venv-zoo/bin/python benchmarks/zoo.py --holdout    # holdout_models.py's set, into benchmarks/.models/holdout

(scripts/build_zoo.sh makes .venv-zoo and runs this.)
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable
from importlib import metadata

import numpy as np
import onnx
import onnxruntime as ort
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zoo_models import SPECS, Feed, Spec  # noqa: E402

EXPORTERS = ("torchscript", "dynamo")
TORCHSCRIPT_OPSET = 17
TOLERANCE = {"fp32": "float32", "optimized": "float32", "fp16": "float16", "int8_dynamic": "int8",
             "int8_qdq": "int8", "int8_qoperator": "int8", "int4": "int4"}
CALIBRATION_SAMPLES = 8
TORCH_CHECK = 1e-3  # a float32 export further than this from torch (relative to the output's magnitude) failed
QUANTIZED_OPS = ("MatMulNBits", "MatMulInteger", "ConvInteger", "QLinearMatMul", "QLinearConv", "QGemm",
                 "QuantizeLinear", "DynamicQuantizeLinear")


# --- feeds ---------------------------------------------------------------------------------------------------


def make_feed(feed: dict, rng: np.random.Generator) -> np.ndarray:
    """One input from its manifest description (tests/cpu/test_zoo.py reads the same fields)."""
    shape, dtype, fill = feed["shape"], np.dtype(feed["dtype"]), feed["fill"]
    if fill == "ids":
        return rng.integers(0, feed["high"], size=shape).astype(dtype)
    if fill == "positions":
        return np.broadcast_to(np.arange(feed["start"], feed["start"] + shape[-1]), shape).astype(dtype)
    if fill == "normal":
        return rng.standard_normal(shape).astype(dtype)
    return (np.ones if fill == "ones" else np.zeros)(shape, dtype)


def make_feeds(feeds: list[Feed], seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f.name: make_feed(f.describe(), rng) for f in feeds}


def torch_args(feeds: list[Feed], arrays: dict[str, np.ndarray]) -> tuple:
    """The forward's arguments: one tensor per plain input, one tuple per group (the past keys/values)."""
    args: list = []
    groups: dict[str, list] = {}
    for feed in feeds:
        tensor = torch.from_numpy(np.ascontiguousarray(arrays[feed.name]))
        if not feed.group:
            args.append(tensor)
        elif feed.group not in groups:
            groups[feed.group] = [tensor]
            args.append(groups[feed.group])
        else:
            groups[feed.group].append(tensor)
    return tuple(tuple(a) if isinstance(a, list) else a for a in args)


# --- export --------------------------------------------------------------------------------------------------


def export_torchscript(module: torch.nn.Module, spec: Spec, path: str) -> None:
    feeds, outputs = spec.feeds(*spec.export_dims), spec.outputs()
    axes = {f.name: f.axes for f in feeds if f.axes} | {name: ax for name, ax in outputs if ax}
    torch.onnx.export(module, torch_args(feeds, make_feeds(feeds)), path, dynamo=False,
                      opset_version=TORCHSCRIPT_OPSET, input_names=[f.name for f in feeds],
                      output_names=[name for name, _ in outputs], dynamic_axes=axes)


def dynamic_shapes(feeds: list[Feed]) -> tuple:
    """torch.export's dynamic_shapes for the forward's arguments, shaped like torch_args."""
    dims = {f.name: {axis: torch.export.Dim.DYNAMIC for axis in f.axes} for f in feeds}
    args, seen = [], set()
    for feed in feeds:
        if not feed.group:
            args.append(dims[feed.name])
        elif feed.group not in seen:
            seen.add(feed.group)
            args.append(tuple(dims[f.name] for f in feeds if f.group == feed.group))
    return tuple(args)


def export_dynamo(module: torch.nn.Module, spec: Spec, path: str) -> None:
    feeds, outputs = spec.feeds(*spec.export_dims), spec.outputs()
    program = torch.onnx.export(module, torch_args(feeds, make_feeds(feeds)), dynamo=True,
                                input_names=[f.name for f in feeds], output_names=[name for name, _ in outputs],
                                dynamic_shapes=dynamic_shapes(feeds))
    program.save(path, external_data=False)


EXPORT = {"torchscript": export_torchscript, "dynamo": export_dynamo}


# --- variants ------------------------------------------------------------------------------------------------


class RandomReader:
    """quantize_static's calibration data: a few random feeds of the model's calibration call."""

    def __init__(self, spec: Spec):
        feeds = spec.feeds(*spec.calls[spec.calibration_call])
        self.samples = iter([make_feeds(feeds, seed) for seed in range(CALIBRATION_SAMPLES)])

    def get_next(self) -> dict | None:
        return next(self.samples, None)


def to_float16(base: str, out: str, _spec: Spec) -> None:
    from onnxruntime.transformers.float16 import convert_float_to_float16

    onnx.save(convert_float_to_float16(onnx.load(base), keep_io_types=True), out)


def int8_dynamic(base: str, out: str, _spec: Spec) -> None:
    from onnxruntime.quantization import quantize_dynamic

    quantize_dynamic(base, out)


def int8_static(quant_format: str) -> Callable[[str, str, Spec], None]:
    def convert(base: str, out: str, spec: Spec) -> None:
        from onnxruntime.quantization import CalibrationDataReader, QuantFormat, quantize_static

        reader = type("Reader", (RandomReader, CalibrationDataReader), {})(spec)
        quantize_static(base, out, reader, quant_format=getattr(QuantFormat, quant_format),
                        op_types_to_quantize=list(spec.static_op_types) if spec.static_op_types else None)

    return convert


def optimized(base: str, out: str, spec: Spec) -> None:
    from onnxruntime.transformers.optimizer import optimize_model

    model_type, heads, hidden = spec.optimizer
    optimize_model(base, model_type=model_type, num_heads=heads, hidden_size=hidden).save_model_to_file(out)


def int4(base: str, out: str, _spec: Spec) -> None:
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    quantizer = MatMulNBitsQuantizer(onnx.load(base), block_size=32, is_symmetric=True)
    quantizer.process()
    quantizer.model.save_model_to_file(out, False)


CONVERT = {"fp16": to_float16, "int8_dynamic": int8_dynamic, "int8_qdq": int8_static("QDQ"),
           "int8_qoperator": int8_static("QOperator"), "optimized": optimized, "int4": int4}


# --- checks and the manifest ---------------------------------------------------------------------------------


def reason(exc: BaseException) -> str:
    """The exception in one line: its first two and last two lines, at most 600 characters."""
    lines = [line.strip() for line in f"{type(exc).__name__}: {exc}".splitlines() if line.strip()]
    if len(lines) > 4:
        lines = lines[:2] + ["..."] + lines[-2:]
    return " | ".join(lines)[:600]


def run_calls(path: str, spec: Spec, reference: Callable | None) -> tuple[dict, dict]:
    """Runs every call in onnxruntime: (calls it ran, with feeds and checks; calls it refused, with reasons)."""
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    calls, refused = {}, {}
    for call, dims in spec.calls.items():
        feeds = spec.feeds(*dims)
        arrays = make_feeds(feeds)
        try:
            got = session.run(None, arrays)
        except Exception as exc:  # onnxruntime refuses this call: recorded, not hidden
            refused[call] = reason(exc)
            continue
        calls[call] = {"feeds": [f.describe() for f in feeds],
                       "outputs": {o.name: list(g.shape) for o, g in zip(session.get_outputs(), got)}}
        if reference is not None:
            calls[call]["torch_max_rel_diff"] = reference(feeds, arrays, got)
    return calls, refused


def torch_reference(module: torch.nn.Module) -> Callable:
    def compare(feeds: list[Feed], arrays: dict, got: list) -> float:
        with torch.no_grad():
            want = module(*torch_args(feeds, arrays))
        want = [want] if isinstance(want, torch.Tensor) else list(want)
        diffs = [float(np.abs(g - w.numpy()).max() / max(np.abs(w.numpy()).max(), 1e-30)) for g, w in zip(got, want)]
        return max(diffs)

    return compare


def describe(path: str) -> dict:
    """File, size, opsets and operator counts (``domain::op`` outside the default domain)."""
    model = onnx.load(path, load_external_data=False)
    ops = collections.Counter(f"{n.domain}::{n.op_type}" if n.domain else n.op_type for n in model.graph.node)
    contrib = {op.split("::")[1]: n for op, n in ops.items() if op.startswith("com.microsoft::")}
    return {"file": os.path.basename(path), "size_bytes": os.path.getsize(path),
            "opsets": {o.domain or "ai.onnx": o.version for o in model.opset_import},
            "contrib_ops": dict(sorted(contrib.items())), "ops": dict(sorted(ops.items()))}


def quantized_nothing(record: dict) -> bool:
    return record["variant"].startswith("int") and not any(
        op.split("::")[-1] in QUANTIZED_OPS for op in record["ops"])


def entry(spec: Spec, exporter: str, variant: str) -> dict:
    return {"name": f"{spec.name}.{exporter}.{variant}", "model": spec.name, "architecture": spec.architecture,
            "description": spec.description, "exporter": exporter, "variant": variant,
            "tolerance": TOLERANCE[variant], "float_reference": f"{spec.name}.{exporter}.fp32.onnx",
            "notes": spec.notes}


def check(path: str, spec: Spec, record: dict, reference: Callable | None) -> dict:
    record.update(describe(path))
    if quantized_nothing(record):
        record["warning"] = "the quantizer changed no operator: the model computes in float32"
    calls, refused = run_calls(path, spec, reference)
    record.update(calls=calls, refused_calls=refused, status="ok" if calls else "failed")
    worst = max((c.get("torch_max_rel_diff", 0.0) for c in calls.values()), default=0.0)
    if not calls:
        record.update(stage="onnxruntime", reason="onnxruntime refused every call: " + "; ".join(refused.values()))
    elif worst > TORCH_CHECK:
        record.update(status="failed", stage="torch check",
                      reason=f"onnxruntime's outputs differ from torch's by {worst:.3g} of their magnitude")
    return record


def build_variant(spec: Spec, exporter: str, variant: str, base: str, out_dir: str) -> dict:
    record = entry(spec, exporter, variant)
    path = os.path.join(out_dir, record["name"] + ".onnx")
    start = time.perf_counter()
    try:
        CONVERT[variant](base, path, spec)
        check(path, spec, record, None)
    except Exception as exc:  # a conversion that fails is listed with its reason
        record.update(status="failed", stage=variant, reason=reason(exc))
    record["build_seconds"] = round(time.perf_counter() - start, 2)
    return record


def build_export(spec: Spec, exporter: str, module: torch.nn.Module, out_dir: str) -> list[dict]:
    record = entry(spec, exporter, "fp32")
    base = os.path.join(out_dir, record["name"] + ".onnx")
    start = time.perf_counter()
    try:
        EXPORT[exporter](module, spec, base)
        check(base, spec, record, torch_reference(module))
    except Exception as exc:  # an exporter that fails is listed with its reason, never dropped
        record.update(status="failed", stage="export", reason=reason(exc))
    record["build_seconds"] = round(time.perf_counter() - start, 2)
    if record["status"] != "ok":
        return [record] + [dict(entry(spec, exporter, v), status="failed", stage="export",
                                reason=f"the {exporter} export failed") for v in spec.variants if v != "fp32"]
    return [record] + [build_variant(spec, exporter, v, base, out_dir) for v in spec.variants if v != "fp32"]


def build_model(spec: Spec, exporter: str, out_dir: str) -> list[dict]:
    try:
        module = spec.build().eval()  # a wrapper is a new module, in training mode unless told
    except Exception as exc:  # the torch model itself cannot be made: every entry says why
        failed = {"status": "failed", "stage": "torch model", "reason": reason(exc)}
        return [dict(entry(spec, exporter, v), **failed) for v in spec.variants]
    return build_export(spec, exporter, module, out_dir)


def versions() -> dict[str, str]:
    names = ("torch", "transformers", "onnx", "onnxscript", "onnxruntime", "numpy")
    return {name: metadata.version(name) for name in names}


def write_manifest(out_dir: str, models: list[dict], seconds: float) -> None:
    manifest = {"generated_by": "benchmarks/zoo.py", "versions": versions(), "build_seconds": round(seconds, 1),
                "models": models}
    with open(os.path.join(out_dir, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)


def summary_line(record: dict) -> str:
    if record["status"] == "ok":
        refused = f", refused: {sorted(record['refused_calls'])}" if record["refused_calls"] else ""
        return f"ok     {record['name']:<40} {record['size_bytes'] / 1e6:6.2f} MB{refused}"
    return f"FAILED {record['name']:<40} {record['reason'][:160]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="the folder (default benchmarks/.models/zoo, or holdout with --holdout)")
    parser.add_argument("--holdout", action="store_true",
                        help="build holdout_models.py's architectures, which no speed work was tuned on")
    parser.add_argument("--models", default="", help="comma-separated model names (default: all)")
    parser.add_argument("--exporters", default=",".join(EXPORTERS))
    args = parser.parse_args(argv)
    if args.holdout:
        from holdout_models import HOLDOUT_SPECS as specs
    else:
        specs = SPECS
    args.out = args.out or os.path.join(os.path.dirname(__file__), ".models", "holdout" if args.holdout else "zoo")
    os.makedirs(args.out, exist_ok=True)
    wanted = set(filter(None, args.models.split(",")))
    start, models = time.perf_counter(), []
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)  # the quantizers' advice on every tensor they skip
    ort.set_default_logger_severity(3)  # the refused calls are in the manifest
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    for spec in specs:
        if wanted and spec.name not in wanted:
            continue
        for exporter in args.exporters.split(","):
            for record in build_model(spec, exporter, args.out):
                models.append(record)
                print(summary_line(record), flush=True)
            write_manifest(args.out, models, time.perf_counter() - start)
    ok = sum(r["status"] == "ok" for r in models)
    print(f"{ok} of {len(models)} models built in {time.perf_counter() - start:.0f} s: {args.out}/manifest.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
