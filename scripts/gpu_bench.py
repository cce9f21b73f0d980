"""Benchmark the CUDA provider against torch on the same GPU (run by scripts/gpu_check.sh).

Rows:
- MatMul TFLOP/s, float16 and float32 (N x N x N): the provider's MatMul kernel called directly on device
  tensors (no host copies in the timing) against ``torch.matmul``.
- A transformer decode step (token in, logits out, host to host): the session eager, the session replaying
  a device graph (``session.graph_capture``), torch eager and torch CUDA graph replay. Attention reads a
  fixed-length KV cache held as weights; the model avoids shape-computing operators so that every node runs
  on the provider.

A row the provider cannot run says why instead of a number. ``--small`` shrinks every size so the script
can be smoke-tested on the simulator (``ONNX_RUNTIME_CUDA_SIM=1``); the timings are then meaningless.
"""

from __future__ import annotations

import argparse
import faulthandler
import time
import traceback

import numpy as np
import onnx_runtime as ort
from onnx import TensorProto, helper, numpy_helper
from onnx_runtime import DataType, Tensor

CUDA = "CUDAExecutionProvider"
LABEL = {DataType.FLOAT: "float32", DataType.FLOAT16: "float16"}
rows: list[tuple[str, str, str, str]] = []  # (what, provider, torch, note)


def torch_cuda():
    """torch when it can use the GPU, else None (the torch columns then say n/a)."""
    try:
        import torch
    except ImportError:
        return None
    return torch if torch.cuda.is_available() else None


def cuda_available() -> str:
    """"" when the CUDA provider can run here, else why not. Registers it in-process if not installed."""
    if CUDA not in ort.get_all_providers():
        from onnx_runtime_ep_cuda import CUDAExecutionProvider

        ort.register_provider(CUDAExecutionProvider)
    for entry in ort.discovery.registry().entries():
        if entry.name == CUDA:
            return entry.availability.reason if not entry.availability.available else ""
    return "not installed"


def timed(fn, sync, budget: float = 1.0, most: int = 50) -> float:
    """Seconds per call of ``fn``: one warm-up, then as many calls as fit ``budget`` (at least 3)."""
    fn()
    sync()
    start = time.perf_counter()
    fn()
    sync()
    once = max(time.perf_counter() - start, 1e-6)
    count = int(min(most, max(3, budget / once)))
    start = time.perf_counter()
    for _ in range(count):
        fn()
    sync()
    return (time.perf_counter() - start) / count


# -- MatMul ----------------------------------------------------------------------------------------------------
def matmul_row(n: int, dtype: DataType, torch) -> None:
    label = f"MatMul {LABEL[dtype]} {n}x{n}x{n} (TFLOP/s)"
    np_dtype = dtype.numpy
    elem = TensorProto.FLOAT16 if dtype is DataType.FLOAT16 else TensorProto.FLOAT
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"], name="mm")], "mm",
                              [helper.make_tensor_value_info(x, elem, [n, n]) for x in "ab"],
                              [helper.make_tensor_value_info("y", elem, [n, n])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    session = ort.InferenceSession(model, providers=[CUDA, "CPUExecutionProvider"])
    placed = session.placement()["mm"]
    if placed.provider != CUDA:
        rows.append((label, "n/a", "", f"MatMul not on CUDA: {placed.rejected.get(CUDA, '?')}"))
        session.close()
        return
    handle = session.provider_handle("cuda")
    node = session.model.graph.nodes[0]
    kernel = handle.hook.get_kernel(node=node, shapes=[(n, n), (n, n)], opset=node.opset, graph=session.model.graph)
    rng = np.random.default_rng(0)
    a_host = (rng.standard_normal((n, n)) / np.sqrt(n)).astype(np_dtype)
    b_host = rng.standard_normal((n, n)).astype(np_dtype)
    a, b = Tensor.from_numpy(a_host, provider=handle), Tensor.from_numpy(b_host, provider=handle)
    flops = 2.0 * n ** 3
    ours = flops / timed(lambda: kernel(a, b), handle.sync) / 1e12
    (y,) = kernel(a, b)
    got = y.numpy()[:64].astype(np.float32)
    want = a_host[:64].astype(np.float32) @ b_host.astype(np.float32)
    error = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
    theirs = ""
    if torch is not None:
        tdtype = torch.float16 if dtype is DataType.FLOAT16 else torch.float32
        ta, tb = torch.from_numpy(a_host.astype(np.float32)).to("cuda", tdtype), \
            torch.from_numpy(b_host.astype(np.float32)).to("cuda", tdtype)
        theirs = f"{flops / timed(lambda: torch.matmul(ta, tb), torch.cuda.synchronize) / 1e12:.1f}"
    rows.append((label, f"{ours:.1f}", theirs or "n/a", f"max rel error {error:.1e}"))
    for t in (a, b, y):
        t.close()
    session.close()


# -- decode step -------------------------------------------------------------------------------------------------
def decode_weights(d, heads, t, f, layers, vocab, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd = d // heads

    def w(*shape, scale):
        return (rng.standard_normal(shape, dtype=np.float32) * scale)

    weights = {"wte": w(vocab, d, scale=1.0), "wout": w(d, vocab, scale=d ** -0.5),
               "gf": np.ones(d, np.float32), "bf": np.zeros(d, np.float32)}
    for i in range(layers):
        weights.update({
            f"g1_{i}": np.ones(d, np.float32), f"b1_{i}": np.zeros(d, np.float32),
            f"g2_{i}": np.ones(d, np.float32), f"b2_{i}": np.zeros(d, np.float32),
            f"wq_{i}": w(heads, d, hd, scale=d ** -0.5), f"kt_{i}": w(heads, hd, t, scale=1.0),
            f"v_{i}": w(heads, t, hd, scale=1.0), f"wo_{i}": w(heads, hd, d, scale=hd ** -0.5),
            f"w1_{i}": w(d, f, scale=d ** -0.5), f"w2_{i}": w(f, d, scale=f ** -0.5),
        })
    return weights


def decode_model(weights, heads, layers, dtype):
    """ids (int64 [1]) -> logits [1, vocab]; attention over a KV cache held as weights."""
    np_dtype = dtype.numpy
    d = weights["wte"].shape[1]
    hd = d // heads
    n = helper.make_node
    inits = [numpy_helper.from_array(v.astype(np_dtype), k) for k, v in weights.items()]
    inits.append(numpy_helper.from_array(np.array(hd ** -0.5, np_dtype), "scale"))
    nodes = [n("Gather", ["wte", "ids"], ["h0"], name="embed", axis=0)]
    h = "h0"
    for i in range(layers):
        p = f"l{i}_"
        nodes += [
            n("LayerNormalization", [h, f"g1_{i}", f"b1_{i}"], [p + "a"], name=p + "ln1", axis=-1, epsilon=1e-5),
            n("MatMul", [p + "a", f"wq_{i}"], [p + "q"], name=p + "q"),  # [1,d] @ [H,d,hd] -> [H,1,hd]
            n("MatMul", [p + "q", f"kt_{i}"], [p + "s"], name=p + "qk"),  # -> [H,1,T]
            n("Mul", [p + "s", "scale"], [p + "ss"], name=p + "scale"),
            n("Softmax", [p + "ss"], [p + "p"], name=p + "softmax", axis=-1),
            n("MatMul", [p + "p", f"v_{i}"], [p + "c"], name=p + "pv"),  # -> [H,1,hd]
            n("MatMul", [p + "c", f"wo_{i}"], [p + "o"], name=p + "o"),  # -> [H,1,d]
            n("ReduceMean", [p + "o"], [p + "om"], name=p + "heads", axes=[0], keepdims=0),  # -> [1,d]
            n("Add", [h, p + "om"], [p + "h1"], name=p + "res1"),
            n("LayerNormalization", [p + "h1", f"g2_{i}", f"b2_{i}"], [p + "m"], name=p + "ln2", axis=-1,
              epsilon=1e-5),
            n("MatMul", [p + "m", f"w1_{i}"], [p + "u"], name=p + "up"),
            n("Sigmoid", [p + "u"], [p + "g"], name=p + "sigmoid"),
            n("Mul", [p + "u", p + "g"], [p + "act"], name=p + "silu"),
            n("MatMul", [p + "act", f"w2_{i}"], [p + "dn"], name=p + "down"),
            n("Add", [p + "h1", p + "dn"], [p + "h2"], name=p + "res2"),
        ]
        h = p + "h2"
    nodes += [n("LayerNormalization", [h, "gf", "bf"], ["hf"], name="lnf", axis=-1, epsilon=1e-5),
              n("MatMul", ["hf", "wout"], ["logits"], name="lm_head")]
    elem = TensorProto.FLOAT16 if dtype is DataType.FLOAT16 else TensorProto.FLOAT
    vocab = weights["wout"].shape[1]
    graph = helper.make_graph(nodes, "decode", [helper.make_tensor_value_info("ids", TensorProto.INT64, [1])],
                              [helper.make_tensor_value_info("logits", elem, [1, vocab])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def torch_decode(torch, weights, heads, layers, dtype):
    """The same decode step in torch: a function of a device int64 [1] tensor."""
    tdtype = torch.float16 if dtype is DataType.FLOAT16 else torch.float32
    w = {k: torch.from_numpy(v).to("cuda", tdtype) for k, v in weights.items()}
    d = weights["wte"].shape[1]
    scale = (d // heads) ** -0.5
    ln = torch.nn.functional.layer_norm

    def step(ids):
        h = w["wte"][ids]
        for i in range(layers):
            a = ln(h, (d,), w[f"g1_{i}"], w[f"b1_{i}"], 1e-5)
            s = torch.matmul(torch.matmul(a, w[f"wq_{i}"]), w[f"kt_{i}"]) * scale
            o = torch.matmul(torch.matmul(torch.softmax(s, dim=-1), w[f"v_{i}"]), w[f"wo_{i}"]).mean(dim=0)
            h = h + o
            u = torch.matmul(ln(h, (d,), w[f"g2_{i}"], w[f"b2_{i}"], 1e-5), w[f"w1_{i}"])
            h = h + torch.matmul(u * torch.sigmoid(u), w[f"w2_{i}"])
        return torch.matmul(ln(h, (d,), w["gf"], w["bf"], 1e-5), w["wout"])

    return step


def decode_rows(sizes: dict, dtype: DataType, torch) -> None:
    d, heads, layers, vocab = sizes["d"], sizes["heads"], sizes["layers"], sizes["vocab"]
    what = (f"decode step {LABEL[dtype]} (d={d}, heads={heads}, kv={sizes['t']}, layers={layers}, "
            f"vocab={vocab}) ms")
    weights = decode_weights(**sizes)
    model = decode_model(weights, heads, layers, dtype)
    # CUDA alone when it can: the CPU provider's own graph passes (e.g. its SiLU fusion) would otherwise
    # rewrite nodes into operators only the CPU runs.
    providers = [CUDA]
    try:
        eager = ort.InferenceSession(model, providers=providers)
    except ort.errors.UnsupportedOperatorError:
        providers = [CUDA, "CPUExecutionProvider"]
        eager = ort.InferenceSession(model, providers=providers)
    elsewhere = [p for p in eager.placement() if p.provider != CUDA]
    if elsewhere:
        reasons = "; ".join(f"{p.node} ({p.op_type}): {p.rejected.get(CUDA, p.provider)}" for p in elsewhere[:3])
        note = f"{len(elsewhere)} node(s) not on CUDA, e.g. {reasons}"
    else:
        note = f"all {len(eager.placement())} nodes on CUDA"
    options = ort.SessionOptions()
    options.add_session_config_entry("session.graph_capture", "1")
    captured = ort.InferenceSession(model, options, providers=providers)
    ids = np.array([7], np.int64)
    handle = eager.provider_handle("cuda")
    eager_s = timed(lambda: eager.run(None, {"ids": ids}), handle.sync)
    (reference,) = eager.run(None, {"ids": ids})
    replay_s = timed(lambda: captured.run(None, {"ids": ids}), handle.sync)
    (replayed,) = captured.run(None, {"ids": ids})
    status = captured.device_graph_status()
    same = float(np.abs(replayed.astype(np.float32) - reference.astype(np.float32)).max())
    torch_eager = torch_graph = "n/a"
    torch_note = ""
    if torch is not None:
        step = torch_decode(torch, weights, heads, layers, dtype)
        device_ids = torch.from_numpy(ids).cuda()
        torch_eager = f"{1e3 * timed(lambda: step(device_ids).cpu(), torch.cuda.synchronize):.3f}"
        static_ids = device_ids.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                step(static_ids)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_logits = step(static_ids)

        def replay():
            static_ids.copy_(torch.from_numpy(ids), non_blocking=False)
            graph.replay()
            return static_logits.cpu()

        torch_graph = f"{1e3 * timed(replay, torch.cuda.synchronize):.3f}"
        theirs = replay().float().numpy()
        torch_note = f"; vs torch max |diff| {float(np.abs(theirs - reference.astype(np.float32)).max()):.2e}"
    rows.append((f"{what}: eager", f"{1e3 * eager_s:.3f}", torch_eager, note + torch_note))
    graph_value = f"{1e3 * replay_s:.3f}" if status == "replaying" else "n/a"
    rows.append((f"{what}: graph replay", graph_value, torch_graph,
                 f"status: {status}; replay vs eager max |diff| {same:.1e}"))
    eager.close()
    captured.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="tiny sizes, for a smoke test on the simulator")
    parser.add_argument("--watchdog", type=float, default=170.0, help="dump stacks and exit after this many s")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.watchdog, exit=True)  # never hang: say where it was stuck
    reason = cuda_available()
    if reason:
        print(f"CUDAExecutionProvider is not available: {reason}")
        return 1
    torch = torch_cuda()
    print(f"torch on the GPU: {'yes, ' + torch.__version__ if torch is not None else 'no (torch columns are n/a)'}")
    n = 64 if args.small else 4096
    sizes = (dict(d=32, heads=2, t=16, f=64, layers=2, vocab=100) if args.small
             else dict(d=1024, heads=16, t=512, f=2816, layers=8, vocab=32000))
    jobs = [(f"MatMul float16 {n}", lambda: matmul_row(n, DataType.FLOAT16, torch)),
            (f"MatMul float32 {n}", lambda: matmul_row(n, DataType.FLOAT, torch)),
            ("decode step float16", lambda: decode_rows(sizes, DataType.FLOAT16, torch))]
    failed = 0
    for name, job in jobs:
        start = time.perf_counter()
        print(f"-- {name} ...", flush=True)
        try:
            job()
        except Exception as exc:  # one broken row must not hide the others
            failed += 1
            traceback.print_exc()
            rows.append((name, "error", "", f"{type(exc).__name__}: {str(exc)[:300]}"))
        print(f"   done in {time.perf_counter() - start:.1f} s", flush=True)
    faulthandler.cancel_dump_traceback_later()
    width = max(len(r[0]) for r in rows)
    print()
    print(f"{'benchmark':<{width}}  {'provider':>10}  {'torch':>10}  note")
    for what, ours, theirs, note in rows:
        print(f"{what:<{width}}  {ours:>10}  {theirs:>10}  {note}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
