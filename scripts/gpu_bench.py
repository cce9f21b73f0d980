"""Benchmark the CUDA provider against torch on the same GPU (run by scripts/gpu_check.sh).

Rows:
- MatMul TFLOP/s, float16 and float32 (N x N x N): the provider's MatMul kernel called directly on device
  tensors (no host copies in the timing) against ``torch.matmul``.
- Attention for a decode step (one query token over a KV cache, grouped-query heads): the provider's fused
  kernel called directly on device tensors against torch's ``scaled_dot_product_attention``, in microseconds
  (the note gives the KV-cache read bandwidth).
- A transformer decode step (token in, logits out, host to host): the session eager, the session replaying
  a device graph (``session.graph_capture``), torch eager and torch CUDA graph replay. Attention reads a
  fixed-length KV cache held as weights; the model uses no shape-computing operators.
- A LLaMA-style decode step, the same four columns: the operators exporters write around attention (Reshape,
  Transpose, rotary Slices, Split, Concat onto a past cache, Expand/Tile for grouped-query heads, a ReduceMean
  axes input), every shape input a constant, so the step is captured like the one above.
- The generate loop (scripts/gpu_generate.py): ``onnx_runtime.generate`` on the zoo's decoders with every decode
  step replayed from a device graph, against torch's greedy loop over the same weights, in tokens/s after the
  first token; the note gives both times to first token and whether the greedy tokens agree.

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
from gpu_generate import MODELS, generate_rows
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


# -- decode attention ----------------------------------------------------------------------------------------------
def attention_row(batch: int, q_heads: int, kv_heads: int, head: int, kv: int, dtype: DataType, torch) -> None:
    """One decode step of the fused Attention kernel (one query token per head over a KV cache of ``kv`` tokens,
    grouped-query heads), called directly on device tensors, against torch's scaled_dot_product_attention."""
    label = f"Attention decode {LABEL[dtype]} (B={batch}, heads={q_heads}/{kv_heads}, d={head}, kv={kv}) us"
    np_dtype = dtype.numpy
    elem = TensorProto.FLOAT16 if dtype is DataType.FLOAT16 else TensorProto.FLOAT
    shapes = {"q": (batch, q_heads, 1, head), "k": (batch, kv_heads, kv, head), "v": (batch, kv_heads, kv, head)}
    graph = helper.make_graph([helper.make_node("Attention", list(shapes), ["y"], name="attn")], "attn",
                              [helper.make_tensor_value_info(n, elem, s) for n, s in shapes.items()],
                              [helper.make_tensor_value_info("y", elem, [batch, q_heads, 1, head])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23)])
    session = ort.InferenceSession(model, providers=[CUDA, "CPUExecutionProvider"])
    placed = session.placement()["attn"]
    if placed.provider != CUDA:
        rows.append((label, "n/a", "", f"Attention not on CUDA: {placed.rejected.get(CUDA, '?')}"))
        session.close()
        return
    handle = session.provider_handle("cuda")
    node = session.model.graph.nodes[0]
    kernel = handle.hook.get_kernel(node=node, shapes=list(shapes.values()), opset=node.opset,
                                    graph=session.model.graph)
    rng = np.random.default_rng(0)
    host = {n: rng.standard_normal(s).astype(np_dtype) for n, s in shapes.items()}
    q, k, v = (Tensor.from_numpy(host[n], provider=handle) for n in shapes)
    seconds = timed(lambda: kernel(q, k, v), handle.sync)
    (y,) = kernel(q, k, v)
    # Reference for the first batch entry in float32 numpy: the `group` query heads of a KV head are its rows.
    group = q_heads // kv_heads
    qf = host["q"][:1].astype(np.float32).reshape(1, kv_heads, group, head)
    kf, vf = host["k"][:1].astype(np.float32), host["v"][:1].astype(np.float32)
    scores = qf @ kf.swapaxes(-1, -2) / np.sqrt(head)
    probs = np.exp(scores - scores.max(axis=-1, keepdims=True))
    want = ((probs / probs.sum(axis=-1, keepdims=True)) @ vf).reshape(1, q_heads, 1, head)
    got = y.numpy()[:1].astype(np.float32)
    error = float(np.abs(got - want).max() / (np.abs(want).max() + 1e-30))
    cache_bytes = 2 * batch * kv_heads * kv * head * np.dtype(np_dtype).itemsize
    theirs = "n/a"
    if torch is not None:
        tdtype = torch.float16 if dtype is DataType.FLOAT16 else torch.float32
        tq, tk, tv = (torch.from_numpy(host[n].astype(np.float32)).to("cuda", tdtype) for n in shapes)
        sdpa = torch.nn.functional.scaled_dot_product_attention
        try:
            sdpa(tq, tk, tv, enable_gqa=True)
            call = lambda: sdpa(tq, tk, tv, enable_gqa=True)  # noqa: E731
        except TypeError:  # torch < 2.5: repeat the KV heads once, outside the timing
            tk, tv = tk.repeat_interleave(group, dim=1), tv.repeat_interleave(group, dim=1)
            call = lambda: sdpa(tq, tk, tv)  # noqa: E731
        theirs = f"{1e6 * timed(call, torch.cuda.synchronize):.1f}"
    rows.append((label, f"{1e6 * seconds:.1f}", theirs,
                 f"KV read at {cache_bytes / seconds / 1e9:.0f} GB/s; max rel error {error:.1e}"))
    for t in (q, k, v, y):
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


def step_rows(what: str, model, feeds: dict[str, np.ndarray], torch, torch_step) -> None:
    """Two rows for one decode step run host to host (feeds in, first output out): the session eager and replaying
    a device graph (``session.graph_capture``), against torch eager and a torch CUDA graph of ``torch_step`` (a
    function of the feeds, by name, as device tensors; both None without torch)."""
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
    handle = eager.provider_handle("cuda")
    eager_s = timed(lambda: eager.run(None, feeds), handle.sync)
    reference = eager.run(None, feeds)[0]
    replay_s = timed(lambda: captured.run(None, feeds), handle.sync)
    replayed = captured.run(None, feeds)[0]
    status = captured.device_graph_status()
    same = float(np.abs(replayed.astype(np.float32) - reference.astype(np.float32)).max())
    torch_eager = torch_graph = "n/a"
    torch_note = ""
    if torch is not None:
        device_feeds = {name: torch.from_numpy(value).cuda() for name, value in feeds.items()}
        torch_eager = f"{1e3 * timed(lambda: torch_step(**device_feeds).cpu(), torch.cuda.synchronize):.3f}"
        static = {name: value.clone() for name, value in device_feeds.items()}
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                torch_step(**static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = torch_step(**static)

        def replay():
            for name, value in feeds.items():
                static[name].copy_(torch.from_numpy(value), non_blocking=False)
            graph.replay()
            return static_out.cpu()

        torch_graph = f"{1e3 * timed(replay, torch.cuda.synchronize):.3f}"
        theirs = replay().float().numpy().reshape(reference.shape)
        torch_note = f"; vs torch max |diff| {float(np.abs(theirs - reference.astype(np.float32)).max()):.2e}"
    rows.append((f"{what}: eager", f"{1e3 * eager_s:.3f}", torch_eager, note + torch_note))
    graph_value = f"{1e3 * replay_s:.3f}" if status == "replaying" else "n/a"
    rows.append((f"{what}: graph replay", graph_value, torch_graph,
                 f"status: {status}; replay vs eager max |diff| {same:.1e}"))
    eager.close()
    captured.close()


def decode_rows(sizes: dict, dtype: DataType, torch) -> None:
    d, heads, layers, vocab = sizes["d"], sizes["heads"], sizes["layers"], sizes["vocab"]
    what = (f"decode step {LABEL[dtype]} (d={d}, heads={heads}, kv={sizes['t']}, layers={layers}, "
            f"vocab={vocab}) ms")
    weights = decode_weights(**sizes)
    step = torch_decode(torch, weights, heads, layers, dtype) if torch is not None else None
    step_rows(what, decode_model(weights, heads, layers, dtype), {"ids": np.array([7], np.int64)}, torch, step)


# -- LLaMA-style decode step: the shape-computing operators exporters write --------------------------------------
def llama_weights(d, heads, kv_heads, past, hidden, layers, vocab, seed=0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    hd = d // heads

    def w(*shape, scale=None):
        return rng.standard_normal(shape, dtype=np.float32) * (shape[0] ** -0.5 if scale is None else scale)

    angles = np.arange(past + 1)[:, None] / 10000 ** (np.arange(hd // 2) / (hd // 2))
    weights = {"wte": w(vocab, d, scale=1.0), "wout": w(d, vocab), "norm_f": np.ones(d, np.float32),
               "cos_table": np.cos(np.concatenate([angles, angles], -1)),
               "sin_table": np.sin(np.concatenate([angles, angles], -1))}
    for i in range(layers):
        weights.update({
            f"norm1_{i}": np.ones(d, np.float32), f"norm2_{i}": np.ones(d, np.float32),
            f"wqkv_{i}": w(d, d + 2 * kv_heads * hd), f"wo_{i}": w(d, d), f"wgu_{i}": w(d, 2 * hidden),
            f"wdown_{i}": w(hidden, d), f"past_k_{i}": w(1, kv_heads, past, hd, scale=1.0),
            f"past_v_{i}": w(1, kv_heads, past, hd, scale=1.0),
        })
    return weights


def llama_model(weights, heads, kv_heads, layers, dtype):
    """(input_ids, position_ids: int64 [1, 1]) -> logits [1, 1, vocab]: RMSNorm, a fused QKV projection split in
    three, rotary embeddings cut with Slice, the new key/value concatenated to a past cache (held as weights),
    grouped-query heads widened with Expand and Tile, a SwiGLU MLP. Reshape targets, Slice bounds, Split sizes,
    Unsqueeze axes, Tile repeats and ReduceMean axes are constants, as exporters write them after folding: the
    kernels read them when they are made, so the step can be captured into a device graph."""
    np_dtype = dtype.numpy
    d = weights["wte"].shape[1]
    hd, group = d // heads, heads // kv_heads
    total = weights["past_k_0"].shape[2] + 1
    n = helper.make_node
    constants = {
        "two": np.array(2.0, np_dtype), "eps": np.array(1e-5, np_dtype), "scale": np.array(hd ** -0.5, np_dtype),
        "last_axis": np.array([-1], np.int64), "axis1": np.array([1], np.int64), "axis2": np.array([2], np.int64),
        "zero1": np.array([0], np.int64), "half1": np.array([hd // 2], np.int64), "end1": np.array([hd], np.int64),
        "qkv_sizes": np.array([d, kv_heads * hd, kv_heads * hd], np.int64),
        "mlp_sizes": np.array([weights["wgu_0"].shape[1] // 2] * 2, np.int64),
        "q_heads": np.array([1, 1, heads, hd], np.int64), "kv_heads": np.array([1, 1, kv_heads, hd], np.int64),
        "expand_to": np.array([1, kv_heads, group, total, hd], np.int64),
        "tile_by": np.array([1, 1, group, 1, 1], np.int64),
        "attn_heads": np.array([1, heads, total, hd], np.int64), "model_dim": np.array([1, 1, d], np.int64),
    }
    inits = [numpy_helper.from_array(v.astype(np_dtype), k) for k, v in weights.items()]
    inits += [numpy_helper.from_array(v, k) for k, v in constants.items()]

    def rms_norm(x, weight, out, p):
        return [n("Pow", [x, "two"], [p + "sq"], name=p + "pow"),
                n("ReduceMean", [p + "sq", "last_axis"], [p + "ms"], name=p + "mean", keepdims=1),
                n("Add", [p + "ms", "eps"], [p + "mse"], name=p + "eps"),
                n("Sqrt", [p + "mse"], [p + "rms"], name=p + "sqrt"),
                n("Div", [x, p + "rms"], [p + "normed"], name=p + "div"),
                n("Mul", [p + "normed", weight], [out], name=p + "scale")]

    def heads_of(x, target, out, p):  # [1, 1, h * hd] -> [1, h, 1, hd]
        return [n("Reshape", [x, target], [p + "split"], name=p + "reshape"),
                n("Transpose", [p + "split"], [out], name=p + "transpose", perm=[0, 2, 1, 3])]

    def rotary(x, out, p):  # x * cos + rotate_half(x) * sin
        return [n("Slice", [x, "zero1", "half1", "last_axis"], [p + "x1"], name=p + "x1"),
                n("Slice", [x, "half1", "end1", "last_axis"], [p + "x2"], name=p + "x2"),
                n("Neg", [p + "x2"], [p + "nx2"], name=p + "neg"),
                n("Concat", [p + "nx2", p + "x1"], [p + "rot"], name=p + "rot", axis=-1),
                n("Mul", [x, "cos4"], [p + "xc"], name=p + "xcos"),
                n("Mul", [p + "rot", "sin4"], [p + "rs"], name=p + "rsin"),
                n("Add", [p + "xc", p + "rs"], [out], name=p + "rotary")]

    nodes = [n("Gather", ["wte", "input_ids"], ["h0"], name="embed", axis=0),
             n("Gather", ["cos_table", "position_ids"], ["cos"], name="cos", axis=0),
             n("Gather", ["sin_table", "position_ids"], ["sin"], name="sin", axis=0),
             n("Unsqueeze", ["cos", "axis1"], ["cos4"], name="cos4"),
             n("Unsqueeze", ["sin", "axis1"], ["sin4"], name="sin4")]
    h = "h0"
    for i in range(layers):
        p = f"l{i}_"
        nodes += rms_norm(h, f"norm1_{i}", p + "a", p + "n1_")
        nodes += [n("MatMul", [p + "a", f"wqkv_{i}"], [p + "qkv"], name=p + "qkv"),
                  n("Split", [p + "qkv", "qkv_sizes"], [p + "q0", p + "k0", p + "v0"], name=p + "split", axis=-1)]
        nodes += heads_of(p + "q0", "q_heads", p + "q1", p + "q_") + heads_of(p + "k0", "kv_heads", p + "k1", p + "k_")
        nodes += heads_of(p + "v0", "kv_heads", p + "v", p + "v_")
        nodes += rotary(p + "q1", p + "q", p + "rq_") + rotary(p + "k1", p + "k", p + "rk_")
        nodes += [
            n("Concat", [f"past_k_{i}", p + "k"], [p + "keys"], name=p + "cat_k", axis=2),
            n("Concat", [f"past_v_{i}", p + "v"], [p + "values"], name=p + "cat_v", axis=2),
            n("Unsqueeze", [p + "keys", "axis2"], [p + "k5"], name=p + "k5"),
            n("Expand", [p + "k5", "expand_to"], [p + "kx"], name=p + "k_expand"),
            n("Reshape", [p + "kx", "attn_heads"], [p + "kh"], name=p + "k_heads"),
            n("Unsqueeze", [p + "values", "axis2"], [p + "v5"], name=p + "v5"),
            n("Tile", [p + "v5", "tile_by"], [p + "vx"], name=p + "v_tile"),
            n("Reshape", [p + "vx", "attn_heads"], [p + "vh"], name=p + "v_heads"),
            n("Transpose", [p + "kh"], [p + "kt"], name=p + "kt", perm=[0, 1, 3, 2]),
            n("MatMul", [p + "q", p + "kt"], [p + "s"], name=p + "qk"),
            n("Mul", [p + "s", "scale"], [p + "ss"], name=p + "scores"),
            n("Softmax", [p + "ss"], [p + "pr"], name=p + "softmax", axis=-1),
            n("MatMul", [p + "pr", p + "vh"], [p + "ctx"], name=p + "pv"),
            n("Transpose", [p + "ctx"], [p + "ctx_t"], name=p + "ctx_t", perm=[0, 2, 1, 3]),
            n("Reshape", [p + "ctx_t", "model_dim"], [p + "ctx_d"], name=p + "ctx_d"),
            n("MatMul", [p + "ctx_d", f"wo_{i}"], [p + "o"], name=p + "o"),
            n("Add", [h, p + "o"], [p + "h1"], name=p + "res1"),
        ]
        nodes += rms_norm(p + "h1", f"norm2_{i}", p + "m", p + "n2_")
        nodes += [n("MatMul", [p + "m", f"wgu_{i}"], [p + "gu"], name=p + "gate_up"),
                  n("Split", [p + "gu", "mlp_sizes"], [p + "g", p + "u"], name=p + "mlp_split", axis=-1),
                  n("Sigmoid", [p + "g"], [p + "sg"], name=p + "sigmoid"),
                  n("Mul", [p + "g", p + "sg"], [p + "silu"], name=p + "silu"),
                  n("Mul", [p + "silu", p + "u"], [p + "act"], name=p + "act"),
                  n("MatMul", [p + "act", f"wdown_{i}"], [p + "dn"], name=p + "down"),
                  n("Add", [p + "h1", p + "dn"], [p + "h2"], name=p + "res2")]
        h = p + "h2"
    nodes += rms_norm(h, "norm_f", "hf", "nf_") + [n("MatMul", ["hf", "wout"], ["logits"], name="lm_head")]
    elem = TensorProto.FLOAT16 if dtype is DataType.FLOAT16 else TensorProto.FLOAT
    vocab = weights["wout"].shape[1]
    inputs = [helper.make_tensor_value_info(name, TensorProto.INT64, [1, 1]) for name in ("input_ids", "position_ids")]
    outputs = [helper.make_tensor_value_info("logits", elem, [1, 1, vocab])]
    graph = helper.make_graph(nodes, "llama_decode", inputs, outputs, initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=9)


def torch_llama(torch, weights, heads, kv_heads, layers, dtype):
    """The same LLaMA-style step in torch: a function of device int64 [1, 1] input_ids and position_ids."""
    tdtype = torch.float16 if dtype is DataType.FLOAT16 else torch.float32
    w = {k: torch.from_numpy(v).to("cuda", tdtype) for k, v in weights.items()}
    d = weights["wte"].shape[1]
    hd, group = d // heads, heads // kv_heads
    hidden = weights["wgu_0"].shape[1] // 2

    def rms(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * weight

    def rotary(x, cos, sin):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    def step(input_ids, position_ids):
        h = w["wte"][input_ids]
        cos, sin = w["cos_table"][position_ids].unsqueeze(1), w["sin_table"][position_ids].unsqueeze(1)
        for i in range(layers):
            q, k, v = (rms(h, w[f"norm1_{i}"]) @ w[f"wqkv_{i}"]).split([d, kv_heads * hd, kv_heads * hd], dim=-1)
            q = rotary(q.view(1, 1, heads, hd).transpose(1, 2), cos, sin)
            k = rotary(k.view(1, 1, kv_heads, hd).transpose(1, 2), cos, sin)
            keys = torch.cat((w[f"past_k_{i}"], k), dim=2)
            values = torch.cat((w[f"past_v_{i}"], v.view(1, 1, kv_heads, hd).transpose(1, 2)), dim=2)
            total = keys.shape[2]
            keys = keys.unsqueeze(2).expand(1, kv_heads, group, total, hd).reshape(1, heads, total, hd)
            values = values.unsqueeze(2).repeat(1, 1, group, 1, 1).reshape(1, heads, total, hd)
            scores = torch.softmax((q @ keys.transpose(-1, -2)) * hd ** -0.5, dim=-1)
            h = h + (scores @ values).transpose(1, 2).reshape(1, 1, d) @ w[f"wo_{i}"]
            gate, up = (rms(h, w[f"norm2_{i}"]) @ w[f"wgu_{i}"]).split([hidden, hidden], dim=-1)
            h = h + (gate * torch.sigmoid(gate) * up) @ w[f"wdown_{i}"]
        return rms(h, w["norm_f"]) @ w["wout"]

    return step


def llama_rows(sizes: dict, dtype: DataType, torch) -> None:
    d, heads, kv_heads, layers = sizes["d"], sizes["heads"], sizes["kv_heads"], sizes["layers"]
    what = (f"llama decode step {LABEL[dtype]} (d={d}, heads={heads}/{kv_heads}, kv={sizes['past'] + 1}, "
            f"layers={layers}, vocab={sizes['vocab']}) ms")
    weights = llama_weights(**sizes)
    feeds = {"input_ids": np.array([[7]], np.int64), "position_ids": np.array([[sizes["past"]]], np.int64)}
    step = torch_llama(torch, weights, heads, kv_heads, layers, dtype) if torch is not None else None
    step_rows(what, llama_model(weights, heads, kv_heads, layers, dtype), feeds, torch, step)


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
    llama = (dict(d=32, heads=4, kv_heads=2, past=15, hidden=64, layers=2, vocab=100) if args.small
             else dict(d=1024, heads=16, kv_heads=4, past=511, hidden=2816, layers=8, vocab=32000))
    jobs = [(f"MatMul float16 {n}", lambda: matmul_row(n, DataType.FLOAT16, torch)),
            (f"MatMul float32 {n}", lambda: matmul_row(n, DataType.FLOAT, torch)),
            ("decode step float16", lambda: decode_rows(sizes, DataType.FLOAT16, torch))]
    for shape in ([(1, 4, 2, 16, 64)] if args.small else [(1, 32, 8, 128, 4096), (8, 32, 8, 128, 8192)]):
        jobs.append((f"Attention decode float16 {shape}", lambda s=shape: attention_row(*s, DataType.FLOAT16, torch)))
    jobs.append(("llama decode step float16", lambda: llama_rows(llama, DataType.FLOAT16, torch)))
    jobs.append(("generate", lambda: rows.extend(generate_rows(MODELS, 16 if args.small else 64, "cuda",
                                                               torch is not None))))
    failed = 0
    for name, job in jobs:
        start, done = time.perf_counter(), len(rows)
        print(f"-- {name} ...", flush=True)
        try:
            job()
        except Exception as exc:  # one broken row must not hide the others
            failed += 1
            traceback.print_exc()
            rows.append((name, "error", "", f"{type(exc).__name__}: {str(exc)[:300]}"))
        for what, ours, theirs, note in rows[done:]:  # now, in case the watchdog stops a later job
            print(f"   {what}: {ours} (torch {theirs or 'n/a'}); {note}", flush=True)
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
