"""ONNX Attention (opset 23, 24, 25) on the fused kernel of kernels/attention.cu.

One kernel computes softmax(Q K^T * scale [softcap] + bias) V without materializing the scores: the causal
frontier (aligned bottom-right with past_key), the opset-25 sliding windows, attn_mask (bool, or float of
any of the three float types; broadcast from rank 1-4; a short last dim masks the trailing keys), the
external-cache lengths of nonpad_kv_seqlen (opset 24) and grouped-query heads. 3-D (B, S, H * D) and 4-D
(B, H, S, D) inputs differ only in the strides passed. past_key/past_value are read in place; present_key/
present_value are written by a separate copy kernel only when the node asks for them.

For few query rows (decode) the KV sequence is split over extra blocks whose partial softmax states a
second kernel merges, so a single token still spreads over the GPU. Softmax runs in float32 whatever the
input type. The optional qk_matmul_output (a debugging output) takes separate, unfused kernels that
materialize the scores. Declined (the node then runs on the CPU): softmax_precision double, head sizes above
MAX_HEAD_SIZE, mixed Q/K/V/past types and integer masks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from onnx_runtime import DataType
from onnx_runtime.errors import InvalidArgumentError

from .context import MAX_GRID, f32, i32, i64, ptr
from .elementwise import FLOAT_TYPES, NULL, Kernels, memo, require_type
from .registry import register

SOURCE = "attention.cu"
NAME = "CUDAExecutionProvider"
THREADS = 128  # ATT_THREADS in attention.cu
GROUPS = (1, 4)  # instantiated query heads per block: 1 for multi-head attention, 4 for grouped queries
STEP = 16  # ATT_WARPS * ATT_KEYS: keys a block consumes per step; splits are multiples of it
MAX_SPLITS = 256  # ATT_MAX_SPLITS
SLOTS = (1, 2, 4, 8)  # instantiated values per lane of the head dimension
MAX_HEAD_SIZE = 32 * SLOTS[-1]
MIN_SPLIT_KEYS = 128  # a split shorter than this costs more in merging than it gains in parallelism
MASK_KIND = {DataType.BOOL: 1, DataType.FLOAT: 2, DataType.FLOAT16: 3, DataType.BFLOAT16: 4}
# softmax_precision values the float32 softmax honours (float, and the half types it is at least as precise as).
SOFTMAX_PRECISIONS = (int(DataType.FLOAT), int(DataType.FLOAT16), int(DataType.BFLOAT16))
QK_MODES = (0, 1, 2, 3)  # qk_matmul_output: raw scores, softcapped, biased, softmax


def _given(items, index: int) -> bool:
    return len(items) > index and bool(items[index])


def _known(shape) -> bool:
    return shape is not None and all(isinstance(d, int) for d in shape)


def _head_sizes(node, shapes) -> tuple[int | None, int | None]:
    """(head_size, v_head_size) when the shapes say them."""
    q, v = shapes[0], shapes[2]
    if not _known(q) or not _known(v) or len(q) != len(v):
        return None, None
    if len(q) == 4:
        return q[3], v[3]
    q_heads, kv_heads = node.attr("q_num_heads"), node.attr("kv_num_heads")
    if len(q) != 3 or not q_heads or not kv_heads:
        return None, None
    return q[2] // int(q_heads), v[2] // int(kv_heads)


def _check(node, shapes, dtypes):
    mode = int(node.attr("qk_matmul_output_mode", 0))
    if mode not in QK_MODES:
        return f"Attention's qk_matmul_output_mode is {mode}; expected 0, 1, 2 or 3"
    precision = node.attr("softmax_precision")
    if precision is not None and int(precision) not in SOFTMAX_PRECISIONS:
        return (f"{NAME} computes Attention's softmax in float32; softmax_precision={int(precision)} is not "
                f"implemented (use 1, 10 or 16, or leave it unset)")
    if _given(node.inputs, 4) != _given(node.inputs, 5):
        return "Attention needs past_key and past_value together"
    if _given(node.inputs, 6) and _given(node.inputs, 4):
        return "Attention's nonpad_kv_seqlen (an external KV cache) cannot be combined with past_key/past_value"
    for attr in ("left_window_size", "right_window_size"):
        if int(node.attr(attr, -1)) < -1:
            return f"Attention's {attr} is {node.attr(attr)}; expected -1 (unbounded) or a size >= 0"
    kinds = [dtypes[i] for i in (0, 1, 2, 4, 5) if _given(node.inputs, i) and i < len(dtypes)]
    if any(d is not None and d != kinds[0] for d in kinds):
        return (f"{NAME} runs Attention with Q, K, V and past_key/past_value of one type, got "
                f"{[d.name.lower() if d is not None else None for d in kinds]}")
    if _given(node.inputs, 3) and len(dtypes) > 3 and dtypes[3] is not None and dtypes[3] not in MASK_KIND:
        return (f"{NAME} takes Attention's attn_mask as bool, float, float16 or bfloat16, not "
                f"{dtypes[3].name.lower()}")
    ranks = {len(shapes[i]) for i in (0, 1, 2) if shapes[i] is not None}
    if ranks - {3, 4} or len(ranks) > 1:
        return f"Attention takes Q, K and V all of rank 3 or all of rank 4, got ranks {sorted(ranks)}"
    if ranks == {3} and (not node.attr("q_num_heads") or not node.attr("kv_num_heads")):
        return "Attention with 3-D Q/K/V needs the attributes q_num_heads and kv_num_heads"
    if _given(node.inputs, 3) and len(shapes) > 3 and shapes[3] is not None and len(shapes[3]) > 4:
        return f"Attention's attn_mask has rank {len(shapes[3])}; at most 4 broadcasts over (B, H, Sq, Skv)"
    if _given(node.inputs, 3) and len(shapes) > 3 and shapes[3] is not None and len(shapes[3]) == 0:
        # The kernel reads a mask along the keys (a shorter one masks the rest); a scalar broadcasts instead.
        return f"{NAME} takes Attention's attn_mask of rank 1 to 4, not a scalar (it runs on CPUExecutionProvider)"
    q, k = shapes[0], shapes[1]
    if _known(q) and _known(k) and len(q) == len(k):
        q_heads, kv_heads = (q[1], k[1]) if len(q) == 4 else (node.attr("q_num_heads"), node.attr("kv_num_heads"))
        if q_heads and kv_heads and int(q_heads) % int(kv_heads):
            return f"Attention's {q_heads} query heads are not a multiple of its {kv_heads} key/value heads"
    sizes = [s for s in _head_sizes(node, shapes) if s is not None]
    if sizes and max(sizes) > MAX_HEAD_SIZE:
        return (f"{NAME}'s Attention kernel takes head sizes up to {MAX_HEAD_SIZE}, got "
                f"{'/'.join(map(str, sizes))}")
    return None


def _contiguous_strides(shape) -> list[int]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return strides[::-1]


@dataclass(frozen=True)
class _Plan:
    """Everything a launch needs for one set of input shapes."""

    batch: int
    q_heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    past_len: int
    head_size: int
    v_head_size: int
    strides: tuple[int, ...]  # (b, h, s) element strides of Q, K, V and Y, in that order
    mask: tuple[int, int, int, int]  # (b, h, s) strides of attn_mask and its last dim (the masked length)
    y_shape: tuple[int, ...]
    group: int
    slots: int
    splits: int
    chunk: int
    grid: int


def _fail(node, message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"node {node.name!r} (Attention): {message}")


def _plan(node, multiprocessors: int, q_shape, k_shape, v_shape, mask_shape, past_shape) -> _Plan:
    rank = len(q_shape)
    if rank not in (3, 4) or len(k_shape) != rank or len(v_shape) != rank:
        raise _fail(node, f"Q, K and V must all be 3-D or all 4-D, got {q_shape}, {k_shape}, {v_shape}")
    if rank == 4:
        batch, q_heads, q_len, head_size = q_shape
        kv_heads, kv_len, v_head_size = k_shape[1], k_shape[2], v_shape[3]
        if k_shape[3] != head_size or v_shape[:3] != k_shape[:3] or k_shape[0] != batch:
            raise _fail(node, f"Q {q_shape}, K {k_shape} and V {v_shape} do not agree")
        dense = [_contiguous_strides(s)[:3] for s in (q_shape, k_shape, v_shape)]
        y_shape = (batch, q_heads, q_len, v_head_size)
        dense.append(_contiguous_strides(y_shape)[:3])
    else:
        q_heads, kv_heads = int(node.attr("q_num_heads")), int(node.attr("kv_num_heads"))
        batch, q_len, kv_len = q_shape[0], q_shape[1], k_shape[1]
        for what, shape, heads in (("Q", q_shape, q_heads), ("K", k_shape, kv_heads), ("V", v_shape, kv_heads)):
            if heads <= 0 or shape[2] % heads:
                raise _fail(node, f"{what} hidden size {shape[2]} does not split into {heads} heads")
        head_size, v_head_size = q_shape[2] // q_heads, v_shape[2] // kv_heads
        if k_shape[2] // kv_heads != head_size or k_shape[:2] != v_shape[:2] or k_shape[0] != batch:
            raise _fail(node, f"Q {q_shape}, K {k_shape} and V {v_shape} do not agree")
        y_shape = (batch, q_len, q_heads * v_head_size)
        # (B, S, H * D): batch stride S * H * D, head stride D, sequence stride H * D.
        dense = [(s[1] * s[2], s[2] // heads, s[2]) for s, heads in
                 ((q_shape, q_heads), (k_shape, kv_heads), (v_shape, kv_heads), (y_shape, q_heads))]
    if kv_heads <= 0 or q_heads % kv_heads:
        raise _fail(node, f"{q_heads} query heads are not a multiple of {kv_heads} key/value heads")
    if max(head_size, v_head_size) > MAX_HEAD_SIZE:
        raise _fail(node, f"head sizes {head_size}/{v_head_size} exceed the CUDA kernel's {MAX_HEAD_SIZE}")
    past_len = 0
    if past_shape is not None:
        if len(past_shape) != 4 or past_shape[:2] != (batch, kv_heads) or past_shape[3] != head_size:
            raise _fail(node, f"past_key {past_shape} does not match (batch, kv heads, *, head size) = "
                              f"({batch}, {kv_heads}, *, {head_size})")
        past_len = past_shape[2]
    total = past_len + kv_len

    mask = (0, 0, 0, 0)
    if mask_shape is not None:
        padded = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
        for dim, want, what in zip(padded[:3], (batch, q_heads, q_len), ("batch", "heads", "query length")):
            if dim not in (1, want):
                raise _fail(node, f"attn_mask {mask_shape} does not broadcast to ({batch}, {q_heads}, {q_len}, "
                                  f"{total}): its {what} dim is {dim}")
        if padded[3] > total:
            raise _fail(node, f"attn_mask {mask_shape} is longer than the {total} keys")
        strides = _contiguous_strides(padded)
        mask = (*(0 if dim == 1 else s for dim, s in zip(padded[:3], strides[:3])), padded[3])

    slots = next(s for s in SLOTS if 32 * s >= max(head_size, v_head_size, 1))
    group = GROUPS[0] if q_heads == kv_heads else GROUPS[-1]
    rows = batch * kv_heads * q_len * -(-(q_heads // kv_heads) // group)
    # Enough blocks for a few per multiprocessor: decode splits its keys, prefill has rows enough.
    splits = 1
    target = 4 * multiprocessors
    if 0 < rows < target and total >= 2 * MIN_SPLIT_KEYS:
        splits = min(-(-target // rows), total // MIN_SPLIT_KEYS, MAX_SPLITS)
    chunk = -(-max(total, 1) // splits)
    chunk = -(-chunk // STEP) * STEP
    splits = -(-max(total, 1) // chunk)
    return _Plan(batch, q_heads, kv_heads, q_len, kv_len, past_len, head_size, v_head_size,
                 tuple(s for strides in dense for s in strides), mask, y_shape, group, slots, splits, chunk,
                 min(max(rows, 1), MAX_GRID))


def _vector_rows(plan: _Plan, dim: int, strides, new, past) -> bool:
    """Whether every lane's slice of a K or V row can load as one vector access (load_pack in attention.cu):
    the slices tile the row exactly and every row starts aligned to the slice size (at most 16 bytes)."""
    align = min(plan.slots * new.dtype.numpy.itemsize, 16)
    if dim % plan.slots or any(s % plan.slots for s in strides):
        return False
    return all(t is None or t.device_ptr % align == 0 for t in (new, past))


def _multiprocessors(ctx) -> int:
    """The device's multiprocessor count, which sizes the KV splits (a guess of 100 if the driver will not say:
    it only tunes parallelism)."""
    device = ctx.device
    attribute = device.driver.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
    err, count = device.driver.cuDeviceGetAttribute(attribute, device.device)
    return int(count) if int(err) == 0 and int(count) > 0 else 100


def _factory(node, shapes, opset, ctx):
    kernels = Kernels(ctx, SOURCE)
    multiprocessors = _multiprocessors(ctx)
    scale_attr = node.attr("scale")
    softcap = float(node.attr("softcap", 0.0))
    causal = int(bool(node.attr("is_causal", 0)))
    # Sliding windows arrived in opset 25; earlier opsets have no such attributes.
    left = int(node.attr("left_window_size", -1)) if opset >= 25 else -1
    right = int(node.attr("right_window_size", -1)) if opset >= 25 else -1
    wants = [_given(node.outputs, i) for i in range(4)]
    qk_mode = int(node.attr("qk_matmul_output_mode", 0))
    plan = memo(lambda *s: _plan(node, multiprocessors, *s))

    def present(past, new, plan_, dim, stride_at):
        """past (B, H, P, dim) followed by the new rows of ``new`` as a dense (B, H, P + S, dim) tensor."""
        out = ctx.empty(new.dtype, (plan_.batch, plan_.kv_heads, plan_.past_len + plan_.kv_len, dim))
        if out.numel:
            name = "kv_concat_16" if new.dtype.numpy.itemsize == 2 else "kv_concat_32"
            strides = plan_.strides[stride_at:stride_at + 3]
            ctx.launch(kernels[name], min(-(-out.numel // 256), MAX_GRID), 256,
                       NULL if past is None else ptr(past), ptr(new), ptr(out), i64(plan_.batch),
                       i64(plan_.kv_heads), i64(plan_.past_len), i64(plan_.kv_len), i64(dim), *map(i64, strides))
        return out

    def kernel(q, k, v, attn_mask=None, past_key=None, past_value=None, nonpad_kv_seqlen=None):
        sfx = require_type(node, q.dtype, FLOAT_TYPES)
        for what, t in (("K", k), ("V", v), ("past_key", past_key), ("past_value", past_value)):
            if t is not None and t.dtype != q.dtype:
                raise _fail(node, f"{what} is {t.dtype.name.lower()} but Q is {q.dtype.name.lower()}")
        if attn_mask is not None and attn_mask.dtype not in MASK_KIND:
            raise _fail(node, f"attn_mask of type {attn_mask.dtype.name.lower()} is not supported on CUDA")
        p = plan(q.shape, k.shape, v.shape, None if attn_mask is None else attn_mask.shape,
                 None if past_key is None else past_key.shape)
        if past_value is not None and past_value.shape != (p.batch, p.kv_heads, p.past_len, p.v_head_size):
            raise _fail(node, f"past_value {past_value.shape} does not match past_key and V")
        if nonpad_kv_seqlen is not None and nonpad_kv_seqlen.numel != p.batch:
            raise _fail(node, f"nonpad_kv_seqlen has {nonpad_kv_seqlen.numel} values for a batch of {p.batch}")
        y = ctx.empty(q.dtype, p.y_shape)
        scale = 1 / math.sqrt(p.head_size) if scale_attr is None else float(scale_attr)

        def args(y_, partial_):  # attention.cu's ATT_PARAMS
            return (ptr(q), ptr(k), ptr(v), NULL if past_key is None else ptr(past_key),
                    NULL if past_value is None else ptr(past_value), NULL if attn_mask is None else ptr(attn_mask),
                    i32(0 if attn_mask is None else MASK_KIND[attn_mask.dtype]),
                    NULL if nonpad_kv_seqlen is None else ptr(nonpad_kv_seqlen), y_, partial_,
                    *map(i64, (p.batch, p.q_heads, p.kv_heads, p.q_len, p.kv_len, p.past_len, p.head_size,
                               p.v_head_size, *p.strides, *p.mask)),
                    f32(scale), f32(softcap), i32(causal), i64(left), i64(right), i64(p.chunk),
                    i32(_vector_rows(p, p.head_size, p.strides[3:6], k, past_key)),
                    i32(_vector_rows(p, p.v_head_size, p.strides[6:9], v, past_value)))

        if y.numel:
            partial = None
            if p.splits > 1:
                partial = ctx.empty(DataType.FLOAT, (p.batch * p.q_heads * p.q_len * p.splits * (p.v_head_size + 2),))
            ctx.launch(kernels[f"attention_{sfx}_g{p.group}_s{p.slots}"], (p.grid, p.splits), THREADS,
                       *args(ptr(y), NULL if partial is None else ptr(partial)))
            if partial is not None:
                rows = p.batch * p.q_heads * p.q_len
                ctx.launch(kernels[f"attention_combine_{sfx}"], min(rows, MAX_GRID), THREADS, ptr(partial), ptr(y),
                           *map(i64, (p.batch, p.q_heads, p.q_len, p.v_head_size, p.splits, *p.strides[9:12])))
                partial.close()
        outputs = [y, None, None, None]
        if wants[1]:
            outputs[1] = present(past_key, k, p, p.head_size, 3)
        if wants[2]:
            outputs[2] = present(past_value, v, p, p.v_head_size, 6)
        if wants[3]:
            outputs[3] = qk = ctx.empty(q.dtype, (p.batch, p.q_heads, p.q_len, p.past_len + p.kv_len))
            if qk.numel:
                scores = ctx.empty(DataType.FLOAT, qk.shape) if qk_mode == 3 else None
                ctx.launch(kernels[f"attention_scores_{sfx}"], min(-(-qk.numel // THREADS), MAX_GRID), THREADS,
                           *args(NULL, NULL), ptr(qk), NULL if scores is None else ptr(scores), i32(qk_mode))
                if scores is not None:
                    rows = qk.numel // qk.shape[-1]
                    ctx.launch(kernels[f"attention_probs_{sfx}"], min(-(-rows // (THREADS // 32)), MAX_GRID),
                               THREADS, ptr(scores), ptr(qk), i64(rows), i64(qk.shape[-1]))
                    scores.close()
        return tuple(outputs[:len(node.outputs)])

    return kernel


TYPED_INPUTS = (0, 1, 2, 4, 5)  # Q, K, V, past_key, past_value (attn_mask and nonpad_kv_seqlen have their own)
# 24 adds nonpad_kv_seqlen, 25 the sliding windows: one factory reads what the opset has.
for _since in (23, 24, 25):
    register("Attention", since=_since, dtypes=FLOAT_TYPES, typed_inputs=TYPED_INPUTS, check=_check)(_factory)
