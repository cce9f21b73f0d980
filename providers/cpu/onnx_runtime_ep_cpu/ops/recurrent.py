"""Recurrent kernels: RNN, GRU and LSTM.

The three share :class:`_RecurrentSpec` (direction, layout, hidden size, clip and the activation
functions, parsed once per node) and one driver, :func:`_run`: it projects every time step of
the input through W in one matmul per direction, then steps a cell over time. Python loops over
time steps only; each step is a few batched matmuls. ``sequence_lens`` is a per-batch mask: past
its length an entry keeps its state and writes zeros to Y, so the reverse direction effectively
starts at each entry's last valid step.
"""

from __future__ import annotations

import numpy as np
from onnx_runtime.errors import InvalidArgumentError

from ..algorithms.activations import hard_sigmoid_of, sigmoid, softplus, softsign
from ..algorithms.precision import compute_dtype, scalar
from ..algorithms.prepared import Prepared
from ..compiled import COMPILED_DTYPES, deferred
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import graph_error, quiet, shape_free

_DIRECTIONS = ("forward", "reverse", "bidirectional")
_FLOAT32 = np.dtype(np.float32)  # the loops' gates vectorize in float32 (compiled/gates.py)


def _relu(x, alpha, beta):
    return np.maximum(x, scalar(0, x.dtype))


def _affine(x, alpha, beta):
    return scalar(alpha, x.dtype) * x + scalar(beta, x.dtype)


def _leaky_relu(x, alpha, beta):
    return np.where(x >= 0, x, scalar(alpha, x.dtype) * x)


def _thresholded_relu(x, alpha, beta):
    return np.where(x >= scalar(alpha, x.dtype), x, scalar(0, x.dtype))


def _scaled_tanh(x, alpha, beta):
    return scalar(alpha, x.dtype) * np.tanh(scalar(beta, x.dtype) * x)


def _elu(x, alpha, beta):
    return np.where(x >= 0, x, scalar(alpha, x.dtype) * np.expm1(x))


# lower-cased name: (function(x, alpha, beta), default alpha, default beta); None = not used.
_ACTIVATIONS = {
    "relu": (_relu, None, None),
    "tanh": (lambda x, alpha, beta: np.tanh(x), None, None),
    "sigmoid": (lambda x, alpha, beta: sigmoid(x), None, None),
    "affine": (_affine, 1.0, 0.0),
    "leakyrelu": (_leaky_relu, 0.01, None),
    "thresholdedrelu": (_thresholded_relu, 1.0, None),
    "scaledtanh": (_scaled_tanh, 1.0, 1.0),
    "hardsigmoid": (lambda x, alpha, beta: hard_sigmoid_of(x, alpha, beta), 0.2, 0.5),
    "elu": (_elu, 1.0, None),
    "softsign": (lambda x, alpha, beta: softsign(x), None, None),
    "softplus": (lambda x, alpha, beta: softplus(x), None, None),
}


class _RecurrentSpec:
    """The attributes shared by RNN, GRU and LSTM, validated once per node.

    ``activations[d]`` holds direction d's activation functions (``per_direction`` of them), each
    a one-argument callable with its alpha/beta bound.
    """

    def __init__(self, node, defaults: tuple[str, ...]):
        self.node = node
        self.direction = node.attr("direction", "forward")
        if self.direction not in _DIRECTIONS:
            raise graph_error(node, "direction", f"is {self.direction!r}; expected one of {', '.join(_DIRECTIONS)}")
        self.num_directions = 2 if self.direction == "bidirectional" else 1
        self.layout = int(node.attr("layout", 0))
        if self.layout not in (0, 1):
            raise graph_error(node, "layout", f"is {self.layout}; expected 0 or 1")
        hidden = node.attr("hidden_size")
        self.hidden_size = None if hidden is None else int(hidden)
        if self.hidden_size is not None and self.hidden_size < 1:
            raise graph_error(node, "hidden_size", f"is {self.hidden_size}; expected a positive size")
        clip = node.attr("clip")
        self.clip = None if clip is None else float(clip)
        if self.clip is not None and self.clip < 0:
            raise graph_error(node, "clip", f"is {self.clip}; expected a non-negative threshold")
        self.activations = self._parse_activations(defaults)

    def _parse_activations(self, defaults):
        node, count = self.node, len(defaults)
        names = list(node.attr("activations") or defaults * self.num_directions)
        if len(names) == count and self.num_directions == 2:
            names *= 2  # one list given for a bidirectional node serves both directions
        if len(names) != count * self.num_directions:
            raise graph_error(
                node, "activations",
                f"has {len(names)} functions; expected {count} per direction ({count * self.num_directions} in all)",
            )
        # alpha/beta values are consumed in order by the activations that take them (as ONNX Runtime does).
        alphas = list(node.attr("activation_alpha") or [])
        betas = list(node.attr("activation_beta") or [])
        bound = []
        for name in names:
            entry = _ACTIVATIONS.get(str(name).lower())
            if entry is None:
                raise graph_error(
                    node, "activations", f"names unknown function {name!r}; expected one of {sorted(_ACTIVATIONS)}"
                )
            fn, alpha, beta = entry
            if alpha is not None and alphas:
                alpha = float(alphas.pop(0))
            if beta is not None and betas:
                beta = float(betas.pop(0))
            bound.append(quiet(lambda x, fn=fn, alpha=alpha, beta=beta: fn(x, alpha, beta)))
        return [bound[d * count:(d + 1) * count] for d in range(self.num_directions)]

    def clipped(self, x: np.ndarray) -> np.ndarray:
        """Apply the cell clip (to the inputs of the activations) when the node sets one."""
        if self.clip is None:
            return x
        return np.minimum(np.maximum(x, scalar(-self.clip, x.dtype)), scalar(self.clip, x.dtype))

    def check(self, w: np.ndarray, r: np.ndarray, gates: int) -> int:
        """The hidden size, after checking the weights against the node's attributes."""
        hidden = r.shape[-1]
        if w.shape[0] != self.num_directions or r.shape[0] != self.num_directions:
            raise InvalidArgumentError(
                f"node {self.node.name!r} ({self.node.op_type}): W {w.shape} and R {r.shape} must have "
                f"{self.num_directions} direction(s) for direction={self.direction!r}"
            )
        size_mismatch = self.hidden_size is not None and hidden != self.hidden_size
        if size_mismatch or r.shape[1] != gates * hidden or w.shape[1] != gates * hidden:
            raise InvalidArgumentError(
                f"node {self.node.name!r} ({self.node.op_type}): W {w.shape} and R {r.shape} do not match "
                f"hidden_size={self.hidden_size} with {gates} gate(s); expected R of shape "
                f"({self.num_directions}, {gates * hidden}, {hidden})"
            )
        return hidden


def _to_time_major(x: np.ndarray | None, layout: int, dtype) -> np.ndarray | None:
    """Layout 1 puts batch first in X and in the states; the cells work time/direction-major."""
    if x is None:
        return None
    return (np.swapaxes(x, 0, 1) if layout else x).astype(dtype, copy=False)


def _run(spec: _RecurrentSpec, cell, x, w, r, b, seq_lens, states, gates: int):
    """Run ``cell`` over X in each direction.

    ``states`` are the optional initial states (initial_h, and initial_c for LSTM), each
    (num_directions, batch, hidden) after layout. ``cell(d, xw_t, states) -> states`` computes one
    step; its first state is the hidden output. Returns Y (seq, dirs, batch, hidden) and the
    final states, in the node's layout and X's dtype.
    """
    dtype = compute_dtype(x.dtype)
    xs = _to_time_major(x, spec.layout, dtype)
    seq, batch = xs.shape[:2]
    hidden = spec.check(w, r, gates)
    _check_bias(b, r, gates, hidden)
    dirs = spec.num_directions
    states = [
        np.zeros((dirs, batch, hidden), dtype) if s is None else _to_time_major(s, spec.layout, dtype) for s in states
    ]
    bias = np.zeros((dirs, 2 * gates * hidden), dtype) if b is None else b.astype(dtype, copy=False)
    lengths = None if seq_lens is None else np.asarray(seq_lens).reshape(-1).astype(np.int64)
    y = np.zeros((seq, dirs, batch, hidden), dtype)
    finals = []
    for d in range(dirs):
        # Every step's input projection, with the input bias, in one matmul.
        xw = xs @ w[d].astype(dtype, copy=False).T + bias[d, : gates * hidden]
        current = [s[d] for s in states]
        backward = spec.direction == "reverse" or d == 1
        for t in range(seq - 1, -1, -1) if backward else range(seq):
            stepped = cell(d, xw[t], current)
            if lengths is None:
                current = stepped
            else:
                valid = (t < lengths)[:, None]
                current = [np.where(valid, new, old) for new, old in zip(stepped, current)]
                stepped[0] = np.where(valid, stepped[0], 0)
            y[t, d] = stepped[0]
        finals.append(current)
    outs = [np.stack([f[i] for f in finals]) for i in range(len(states))]
    if spec.layout:
        y = y.transpose(2, 0, 1, 3)
        outs = [np.swapaxes(o, 0, 1) for o in outs]
    return [o.astype(x.dtype, copy=False) for o in (y, *outs)]


def _outputs(node, values) -> tuple:
    """One value per listed output (Y, Y_h[, Y_c]), omitted ("") ones included."""
    return tuple(values[: len(node.outputs)])


def _check_bias(b: np.ndarray | None, r: np.ndarray, gates: int, hidden: int) -> None:
    """B is (num_directions, 2 * gates * hidden), num_directions R's first dimension (checked against the node's
    direction with W's by _RecurrentSpec.check)."""
    if b is not None and (r.ndim != 3 or b.shape != (r.shape[0], 2 * gates * hidden)):
        raise InvalidArgumentError(f"input B of shape {b.shape} does not match R of shape {r.shape}: expected "
                                   f"({r.shape[0] if r.ndim else '?'}, {2 * gates * hidden}), the input and "
                                   f"recurrence biases of {gates} gate(s) per direction; fix B or R")


def _recurrence(r: np.ndarray, b: np.ndarray | None, gates: int, hidden: int, dtype):
    """Per direction, R transposed and the recurrence bias Rb."""
    _check_bias(b, r, gates, hidden)
    rt = [r[d].astype(dtype, copy=False).T for d in range(r.shape[0])]
    if b is None:
        return rt, [np.zeros(gates * hidden, dtype)] * r.shape[0]
    return rt, [b[d, gates * hidden:].astype(dtype, copy=False) for d in range(r.shape[0])]


@register("RNN", since=1)
def rnn(node, shapes, opset):
    # Later versions only added layout (14) and types, which the attribute defaults cover.
    spec = _RecurrentSpec(node, ("Tanh",))

    def kernel(x, w, r, b=None, seq_lens=None, h0=None):
        dtype = compute_dtype(x.dtype)
        rt, rb = _recurrence(r, b, 1, r.shape[-1], dtype)

        def cell(d, xw_t, states):
            (f,) = spec.activations[d]
            return [f(spec.clipped(xw_t + states[0] @ rt[d] + rb[d]))]

        return _outputs(node, _run(spec, cell, x, w, r, b, seq_lens, [h0], gates=1))

    return kernel


@register("GRU", since=1)
def gru(node, shapes, opset):
    # linear_before_reset (GRU-3) and layout (GRU-14) default to the earlier behaviour.
    spec = _RecurrentSpec(node, ("Sigmoid", "Tanh"))
    linear_before_reset = bool(node.attr("linear_before_reset", 0))
    names = [str(name).lower() for name in node.attr("activations") or ()]
    compiled = _CompiledGRU(spec, linear_before_reset) \
        if (not names or names == ["sigmoid", "tanh"] * spec.num_directions) and spec.clip is None else None
    outputs = len(node.outputs)

    def kernel(x, w, r, b=None, seq_lens=None, h0=None):
        fast = compiled.fast if compiled is not None else None
        if fast is not None and fast[0] is w and fast[1] is r and fast[2] is b and seq_lens is None \
                and x.shape == fast[3] and x.dtype is fast[4] and x.flags.c_contiguous \
                and (None if h0 is None else h0.shape) == fast[5]:
            return compiled.one_direction(x, h0, fast)[:outputs]  # (a repeat of a checked streaming frame)
        if compiled is not None and seq_lens is None and x.dtype in COMPILED_DTYPES and w.dtype == x.dtype \
                and r.dtype == x.dtype and x.ndim == 3 and x.shape[0 if spec.layout else 1] <= _COMPILED_BATCH:
            found = compiled(x, w, r, b, h0)
            if found is not None:
                return tuple(found[:outputs])
        dtype = compute_dtype(x.dtype)
        hidden = r.shape[-1]
        rt, rb = _recurrence(r, b, 3, hidden, dtype)

        def cell(d, xw_t, states):
            f, g = spec.activations[d]
            h = states[0]
            # Gate order is z (update), r (reset), h (hidden).
            zr = xw_t[:, : 2 * hidden] + h @ rt[d][:, : 2 * hidden] + rb[d][: 2 * hidden]
            z = f(spec.clipped(zr[:, :hidden]))
            reset = f(spec.clipped(zr[:, hidden:]))
            r_h, rb_h = rt[d][:, 2 * hidden:], rb[d][2 * hidden:]
            if linear_before_reset:
                recur = reset * (h @ r_h + rb_h)
            else:
                recur = (reset * h) @ r_h + rb_h
            candidate = g(spec.clipped(xw_t[:, 2 * hidden:] + recur))
            return [(1 - z) * candidate + z * h]

        return _outputs(node, _run(spec, cell, x, w, r, b, seq_lens, [h0], gates=3))

    return shape_free(kernel)  # (as LSTM's: it reads no planned shape)


@register("LSTM", since=1)
def lstm(node, shapes, opset):
    # Later versions only dropped output_sequence and added layout (14) and types.
    spec = _RecurrentSpec(node, ("Sigmoid", "Tanh", "Tanh"))
    input_forget = bool(node.attr("input_forget", 0))
    names = [str(name).lower() for name in node.attr("activations") or ()]
    plain = (not names or names == ["sigmoid", "tanh", "tanh"] * spec.num_directions) and spec.clip is None \
        and not input_forget
    compiled = _CompiledLSTM(spec) if plain else None
    outputs = len(node.outputs)

    def kernel(x, w, r, b=None, seq_lens=None, h0=None, c0=None, p=None):
        fast = compiled.fast if compiled is not None else None
        if fast is not None and fast[0] is w and fast[1] is r and fast[2] is b and seq_lens is None and p is None \
                and x.shape == fast[3] and x.dtype is fast[4] and x.flags.c_contiguous and h0 is not None \
                and c0 is not None and h0.shape == fast[5] and c0.shape == fast[5]:
            return compiled.one_direction(x, h0, c0, fast)[:outputs]  # (a repeat of a checked streaming frame)
        if compiled is not None and p is None and seq_lens is None and x.dtype in COMPILED_DTYPES \
                and w.dtype == x.dtype and r.dtype == x.dtype and x.ndim == 3 \
                and x.shape[0 if spec.layout else 1] <= _COMPILED_BATCH:
            found = compiled(x, w, r, b, h0, c0)
            if found is not None:
                return tuple(found[:outputs])
        dtype = compute_dtype(x.dtype)
        hidden = r.shape[-1]
        rt, rb = _recurrence(r, b, 4, hidden, dtype)
        peep = None if p is None else p.astype(dtype, copy=False).reshape(r.shape[0], 3, hidden)

        def cell(d, xw_t, states):
            f, g, h_act = spec.activations[d]
            h, c = states
            # Gate order is i (input), o (output), f (forget), c (cell).
            pre = xw_t + h @ rt[d] + rb[d]
            pre_i, pre_o, pre_f, pre_c = (pre[:, k * hidden:(k + 1) * hidden] for k in range(4))
            if peep is not None:
                pre_i = pre_i + peep[d, 0] * c
                pre_f = pre_f + peep[d, 2] * c
            i = f(spec.clipped(pre_i))
            forget = 1 - i if input_forget else f(spec.clipped(pre_f))
            c_new = forget * c + i * g(spec.clipped(pre_c))
            if peep is not None:
                pre_o = pre_o + peep[d, 1] * c_new
            o = f(spec.clipped(pre_o))
            return [o * h_act(c_new), c_new]

        return _outputs(node, _run(spec, cell, x, w, r, b, seq_lens, [h0, c0], gates=4))

    # (It reads no planned shape: a streaming model's omitted sequence_lens would otherwise send every call
    # through the shape-keyed cache's slow key.)
    return shape_free(kernel)


# Up to this many (time step, batch entry) pairs the compiled loop also projects the input; past it one
# BLAS product does, ahead of the loop.
_PROJECT_IN_LOOP = 16
# The compiled loop reads R once per batch entry and step (dot products), BLAS once per step: past a few
# entries the numpy path's batched products read less.
_COMPILED_BATCH = 4


def _lstm_weights(w, r, b, hidden: int, dtype) -> list:
    """Per direction: W^T and R^T contiguous (the loop's layout), and the two biases summed (Wb + Rb)."""
    weights = []
    for d in range(w.shape[0]):
        bias = np.zeros(4 * hidden, dtype) if b is None else b[d, : 4 * hidden] + b[d, 4 * hidden:]
        weights.append((np.ascontiguousarray(w[d].T, dtype), np.ascontiguousarray(r[d].T, dtype),
                        np.ascontiguousarray(bias, dtype)))
    return weights


class _CompiledRecurrence:
    """What the compiled LSTM and GRU share: weights laid out once per constant (W, R, B), and fresh states."""

    OP = ""
    KIND = ""

    def __init__(self, spec: _RecurrentSpec, steps, laid_out):
        self.spec = spec
        self.steps = steps
        self.laid_out = laid_out  # (W, R, B, hidden, dtype) -> per direction, the weights as the loop reads them
        self.prepared = Prepared()
        # (W, R, B, dtype, weights): Prepared's rule, inlined for one call's worth of Python (one tuple: sessions
        # may run from several threads)
        self.kept: tuple = (None, None, None, None, None)
        self.backward = [spec.direction == "reverse" or d == 1 for d in range(spec.num_directions)]
        # (W, R, B, X's shape and dtype, the states' shape, ..., the weights, Y's shapes, the loop's last arguments)
        self.fast: tuple | None = None
        self.tried = False  # a compiled call has run whole (see stepped)

    def _weights(self, w, r, b, hidden: int, dtype) -> list:
        held = self.kept
        if held[0] is w and held[1] is r and held[2] is b and held[3] is dtype:
            return held[4]
        weights = self.prepared.get((self.KIND, dtype), (w, r, b), lambda: self.laid_out(w, r, b, hidden, dtype))
        if all(a is None or not a.flags.writeable for a in (w, r, b)):
            self.kept = (w, r, b, dtype, weights)
        return weights

    def _state(self, s, shape: tuple, dtype, name: str = "initial_h") -> np.ndarray:
        """A fresh C-contiguous (directions, batch, hidden) state the loop updates in place: zeros, or a copy of
        the input ``name``."""
        if s is None:
            return np.zeros(shape, dtype)
        state = np.array(np.swapaxes(s, 0, 1) if self.spec.layout else s, dtype=dtype, order="C")
        if state.shape != shape:
            raise InvalidArgumentError(
                f"node {self.spec.node.name!r} ({self.OP}): initial state {name} {s.shape} must be {shape} after "
                f"layout; feed a state of that shape or omit it")
        return state


class _CompiledLSTM(_CompiledRecurrence):
    """LSTM with the default activations, no clip, peepholes or sequence lengths, by compiled/lstm.py: the
    same outputs as :func:`_run` (Y, Y_h, Y_c in the node's layout). A streaming model calls it once per
    frame for one step, so the per-call Python is kept to the checks and the state copies."""

    OP, KIND = "LSTM", "lstm"

    def __init__(self, spec: _RecurrentSpec):
        from ..compiled.lstm import lstm_steps

        super().__init__(spec, lstm_steps, _lstm_weights)

    def __call__(self, x, w, r, b, h0, c0) -> list | None:
        fast = self.fast
        if fast is not None and fast[0] is w and fast[1] is r and fast[2] is b and x.shape == fast[3] \
                and x.dtype is fast[4] and x.flags.c_contiguous and _state_shape(h0) == fast[5] \
                and _state_shape(c0) == fast[5]:
            return self.one_direction(x, h0, c0, fast)
        spec = self.spec
        dtype = x.dtype
        xs = np.swapaxes(x, 0, 1) if spec.layout else x
        if not xs.flags.c_contiguous:
            xs = np.ascontiguousarray(xs)
        seq, batch = xs.shape[:2]
        hidden = spec.check(w, r, 4)
        dirs = spec.num_directions
        if xs.ndim != 3 or xs.shape[2] != w.shape[2]:
            raise InvalidArgumentError(
                f"node {spec.node.name!r} (LSTM): X {x.shape} does not match W {w.shape}: expected "
                f"{w.shape[2]} features")
        shape = (dirs, batch, hidden)
        h = self._state(h0, shape, dtype)
        c = self._state(c0, shape, dtype, "initial_c")
        y = np.empty((seq, dirs, batch, hidden), dtype)
        projected = seq * batch > _PROJECT_IN_LOOP
        weights = self._weights(w, r, b, hidden, dtype)
        calls = []
        for d, (wd, rd, bias) in enumerate(weights):
            out = np.empty((seq, batch, hidden), dtype) if dirs > 1 else y.reshape(seq, batch, hidden)
            calls.append((xs @ wd if projected else xs, wd, rd, bias, h[d], c[d], out, self.backward[d], projected,
                          dtype is _FLOAT32))
        if not stepped(self, self.steps, calls):
            return None  # (h and c are this call's copies: numpy starts again from the states fed)
        for d, arguments in enumerate(calls if dirs > 1 else ()):
            y[:, d] = arguments[6]
        if spec.layout:
            return [y.transpose(2, 0, 1, 3), np.swapaxes(h, 0, 1), np.swapaxes(c, 0, 1)]
        if dirs == 1 and weights is self.kept[4] and not projected and self.tried:
            # (checked above for this signature: later calls with it skip the checks and the layout moves)
            self.fast = (w, r, b, x.shape, dtype, shape, weights[0], ((seq, 1, batch, hidden), (seq, batch, hidden)),
                         (self.backward[0], False, dtype is _FLOAT32), direct_entry(self.steps, calls[0]))
        return [y, h, c]

    def one_direction(self, x, h0, c0, fast) -> list:
        """A call with the signature ``fast`` records (one forward or reverse direction, layout 0, few steps,
        constant weights), whose checks passed: fresh states, the loop, the outputs."""
        dtype, shape, (wd, rd, bias), (y_shape, rows), tail = fast[4], fast[5], fast[6], fast[7], fast[8]
        h = np.zeros(shape, dtype) if h0 is None else np.array(h0, dtype=dtype, order="C")
        c = np.zeros(shape, dtype) if c0 is None else np.array(c0, dtype=dtype, order="C")
        y = np.empty(y_shape, dtype)
        fast[9](x, wd, rd, bias, h[0], c[0], y.reshape(rows), *tail)
        return [y, h, c]


def _state_shape(s) -> tuple | None:
    return None if s is None else s.shape


@register("LSTMCell", domain=FUSED_DOMAIN, since=1)
def lstm_cell(node, shapes, opset):
    """recurrent_fusions' one LSTM step: inputs x (B, I), h (B, H), c (B, H) and the cell's float32 W^T (I, 4H),
    R^T (H, 4H), bias (4H) in gate order i, o, f, c; outputs h', c' (B, H)."""
    from ..compiled.lstm import lstm_steps

    def kernel(x, h, c, w, r, bias):
        hidden = r.shape[0]
        if x.ndim != 2 or x.shape[1] != w.shape[0] or h.shape != (x.shape[0], hidden) or c.shape != h.shape:
            raise InvalidArgumentError(
                f"node {node.name!r} (LSTMCell): x {x.shape}, h {h.shape} and c {c.shape} must be (batch, "
                f"{w.shape[0]}), (batch, {hidden}) and (batch, {hidden}) for this cell's weights; feed the shapes the "
                f"model's LSTM cell was exported with")
        h_new = np.array(h, np.float32, order="C")
        c_new = np.array(c, np.float32, order="C")
        xs = np.ascontiguousarray(x, np.float32).reshape(1, *x.shape)
        if stepped(state, lstm_steps, [(xs, w, r, bias, h_new, c_new, np.empty((1, *h.shape), np.float32), False,
                                        False, True)]):
            return [h_new, c_new]
        return _cell_by_numpy(x, h, c, w, r, bias)

    state = _Tried()
    return shape_free(kernel)


class _Tried:
    tried = False  # (see stepped)


def _cell_by_numpy(x, h, c, w, r, bias) -> list:
    """One LSTM step in float32 numpy, gate order i, o, f, c (the compiled loop's), for when it must not compile."""
    pre = np.asarray(x, np.float32) @ w + np.asarray(h, np.float32) @ r + bias
    hidden = r.shape[0]
    i, o, f = (sigmoid(pre[:, k * hidden:(k + 1) * hidden]) for k in range(3))
    c_new = f * c + i * np.tanh(pre[:, 3 * hidden:])
    return [(o * np.tanh(c_new)).astype(np.float32, copy=False), c_new.astype(np.float32, copy=False)]


class _CompiledGRU(_CompiledRecurrence):
    """GRU with the default activations and no clip or sequence lengths, by compiled/gru.py: the same outputs as
    :func:`_run` (Y, Y_h in the node's layout). None where numpy serves the call instead: while numba loads in the
    background (the loop's argument types recorded for the loader), or where the loop misses numba's cache on this
    thread (tried in a Trial until one call has run: the loader's child compiles it meanwhile)."""

    OP, KIND = "GRU", "gru"

    def __init__(self, spec: _RecurrentSpec, linear_before_reset: bool):
        from ..compiled.gru import gru_steps

        super().__init__(spec, gru_steps, _gru_weights)
        self.linear_before_reset = linear_before_reset

    def __call__(self, x, w, r, b, h0) -> list | None:
        fast = self.fast
        if fast is not None and fast[0] is w and fast[1] is r and fast[2] is b and x.shape == fast[3] \
                and x.dtype is fast[4] and x.flags.c_contiguous and _state_shape(h0) == fast[5]:
            return self.one_direction(x, h0, fast)
        return self._checked(x, w, r, b, h0)

    def one_direction(self, x, h0, fast) -> list:
        """A call with the signature ``fast`` records (one direction, layout 0, few steps, constant weights, the
        loop tried), whose checks passed: a fresh state, the loop, the outputs."""
        dtype, shape, (wd, rd, w_bias, r_bias), (y_shape, rows), tail = fast[4], fast[6], fast[7], fast[8], fast[9]
        h = np.zeros(shape, dtype) if h0 is None else np.array(h0, dtype=dtype, order="C")
        y = np.empty(y_shape, dtype)
        fast[10](x, wd, rd, w_bias, r_bias, h[0], y.reshape(rows), *tail)
        return [y, h]

    def _checked(self, x, w, r, b, h0) -> list | None:
        spec = self.spec
        xs = np.swapaxes(x, 0, 1) if spec.layout else x
        if not xs.flags.c_contiguous:
            xs = np.ascontiguousarray(xs)
        hidden = spec.check(w, r, 3)
        _check_bias(b, r, 3, hidden)
        if xs.shape[2] != w.shape[2]:
            raise InvalidArgumentError(f"node {spec.node.name!r} (GRU): X {x.shape} does not match W {w.shape}: "
                                       f"expected {w.shape[2]} features")
        seq, batch = xs.shape[:2]
        dirs = spec.num_directions
        h = self._state(h0, (dirs, batch, hidden), x.dtype)
        y = np.empty((seq, dirs, batch, hidden), x.dtype)
        projected = seq * batch > _PROJECT_IN_LOOP
        calls = []
        for d, (wd, rd, w_bias, r_bias) in enumerate(self._weights(w, r, b, hidden, x.dtype)):
            out = np.empty((seq, batch, hidden), x.dtype) if dirs > 1 else y.reshape(seq, batch, hidden)
            calls.append((xs @ wd if projected else xs, wd, rd, w_bias, r_bias, h[d], out, self.backward[d],
                          projected, self.linear_before_reset, x.dtype is _FLOAT32))
        if not stepped(self, self.steps, calls):
            return None
        for d, arguments in enumerate(calls if dirs > 1 else ()):
            y[:, d] = arguments[6]
        if spec.layout:
            return [y.transpose(2, 0, 1, 3), np.swapaxes(h, 0, 1)]
        if dirs == 1 and not projected and self.tried and self.kept[4] is not None and self.kept[0] is w:
            # (checked above for this signature: later calls with it skip the checks and the layout moves)
            self.fast = (w, r, b, x.shape, x.dtype, _state_shape(h0), (dirs, batch, hidden), self.kept[4][0],
                         ((seq, 1, batch, hidden), (seq, batch, hidden)),
                         (self.backward[0], False, self.linear_before_reset, x.dtype is _FLOAT32),
                         direct_entry(self.steps, calls[0]))
        return [y, h]


def direct_entry(steps, arguments: tuple):
    """The compiled loop's overload for ``arguments``' types (a streaming signature that has run whole), called
    without numba's dispatcher, whose typing of the eleven arguments on every call costs about what a one-step
    loop does; the loop itself where it is not a compiled Loop or has no linked overload."""
    if not isinstance(steps, deferred.Loop):
        return steps
    try:
        dispatcher = steps.dispatcher()
        found = deferred.overload(steps, tuple(dispatcher.typeof_pyval(a) for a in arguments))
    except (TypeError, ValueError):
        return steps
    return steps if found is None else found


def stepped(owner, steps, calls: list) -> bool:
    """``steps(*arguments)`` for each of ``calls`` (a compiled recurrence loop), or False where numpy must serve
    this call instead: while numba loads in the background (the calls' argument types recorded for the loader),
    or where the loop misses numba's cache on this thread (tried in a Trial until one call has run whole, then
    ``owner.tried``: the loader's child compiles it meanwhile), so a cold cache never compiles on a run's thread."""
    if deferred.numpy_first():
        expect = getattr(steps, "expect", None)  # (a compiled Loop's)
        for arguments in calls if expect is not None else ():
            expect(*arguments)
        return False
    for arguments in calls:
        if owner.tried:
            steps(*arguments)
        elif deferred.tried(owner, "tried", _call, steps, arguments) is None:
            return False
    return True


def _call(steps, arguments) -> bool:
    steps(*arguments)
    return True


def _gru_weights(w, r, b, hidden: int, dtype) -> list:
    """Per direction: W^T and R^T contiguous (the loop's layout), Wb and Rb (zeros without B)."""
    weights = []
    for d in range(w.shape[0]):
        w_bias = np.zeros(3 * hidden, dtype) if b is None else np.ascontiguousarray(b[d, : 3 * hidden], dtype)
        r_bias = np.zeros(3 * hidden, dtype) if b is None else np.ascontiguousarray(b[d, 3 * hidden:], dtype)
        weights.append((np.ascontiguousarray(w[d].T, dtype), np.ascontiguousarray(r[d].T, dtype), w_bias, r_bias))
    return weights
