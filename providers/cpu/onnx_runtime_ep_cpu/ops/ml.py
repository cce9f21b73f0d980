"""Kernels of the ai.onnx.ml domain: LabelEncoder, TreeEnsemble, ArrayFeatureExtractor, Binarizer.

LabelEncoder looks keys up with ``np.searchsorted`` in the sorted keys (strings included, as
object arrays), so mapping a tensor costs no Python loop over its elements. TreeEnsemble walks
every (row, tree) pair one level per step: Python loops over tree depth only.
"""

from __future__ import annotations

import math

import numpy as np
from onnx_runtime import budget
from onnx_runtime.errors import InvalidArgumentError, InvalidGraphError

from ..algorithms.erf import erf
from ..registry import register
from ._common import graph_error

ML = "ai.onnx.ml"


def _is_string(x: np.ndarray) -> bool:
    return x.dtype.kind in "OUS"


# -- LabelEncoder ----------------------------------------------------------------------------------


class _Lookup:
    """Maps each element equal to ``keys[i]`` to ``values[i]``, anything else to ``default``.

    A repeated key maps to its last value; a NaN key matches every NaN input.
    """

    def __init__(self, keys: np.ndarray, values: np.ndarray, default):
        self.values_dtype = values.dtype
        self.default = np.asarray(default, dtype=values.dtype)
        self.string_keys = _is_string(keys)
        self.nan_value = None
        if keys.dtype.kind == "f":
            nan = np.isnan(keys)
            if nan.any():
                self.nan_value = values[np.flatnonzero(nan)[-1]]
            keys, values = keys[~nan], values[~nan]
        # np.unique keeps each key's first index; on the reversed lists that is its last occurrence.
        self.keys, first = np.unique(keys[::-1], return_index=True)
        self.values = values[::-1][first]

    def __call__(self, x: np.ndarray) -> np.ndarray:
        if _is_string(x) != self.string_keys:
            kind = "strings" if self.string_keys else "numbers"
            raise InvalidArgumentError(f"LabelEncoder: input has dtype {x.dtype}; its keys are {kind}")
        flat = x.astype(object if self.string_keys else self.keys.dtype, copy=False).reshape(-1)
        if self.keys.size:
            pos = np.minimum(np.searchsorted(self.keys, flat), self.keys.size - 1)
            out = np.where(self.keys[pos] == flat, self.values[pos], self.default)
        else:
            out = np.full(flat.shape, self.default, dtype=self.values_dtype)
        if self.nan_value is not None:
            out = np.where(np.isnan(flat), self.nan_value, out)
        return out.astype(self.values_dtype, copy=False).reshape(x.shape)


# keys_*/values_* list attribute -> element dtype; the default_* attribute each values_* type uses
_LIST_DTYPES = {"strings": object, "int64s": np.int64, "floats": np.float32}
_DEFAULTS = {
    "strings": ("default_string", "_Unused"),
    "int64s": ("default_int64", -1),
    "floats": ("default_float", -0.0),
}


def _encoder_array(node, prefix: str, with_tensor: bool) -> tuple[np.ndarray, str]:
    """The one keys_*/values_* attribute present (as a 1-D array) and its type suffix."""
    names = [f"{prefix}_{suffix}" for suffix in _LIST_DTYPES] + ([f"{prefix}_tensor"] if with_tensor else [])
    present = [name for name in names if node.attr(name) is not None]
    if len(present) != 1:
        raise InvalidGraphError(
            f"node {node.name!r} (LabelEncoder): has {present or 'none'} of {names}; expected exactly one"
        )
    name = present[0]
    suffix = name[len(prefix) + 1:]
    if suffix == "tensor":
        return np.asarray(node.attr(name)).reshape(-1), suffix
    return np.array(node.attr(name), dtype=_LIST_DTYPES[suffix]).reshape(-1), suffix


def _value_kind(values: np.ndarray) -> str:
    """The _DEFAULTS key whose default_* attribute applies to values of this dtype."""
    if _is_string(values):
        return "strings"
    return "floats" if values.dtype.kind == "f" else "int64s"


def _encoder_lookup(node, with_tensor: bool) -> _Lookup:
    keys, _ = _encoder_array(node, "keys", with_tensor)
    values, _ = _encoder_array(node, "values", with_tensor)
    if keys.size != values.size:
        raise graph_error(node, "values", f"has {values.size} entries for {keys.size} keys; expected one per key")
    if with_tensor and node.attr("default_tensor") is not None:
        default = np.asarray(node.attr("default_tensor")).reshape(-1)
        if default.size != 1:
            raise graph_error(node, "default_tensor", f"has {default.size} elements; expected one")
        default = default[0]
    else:
        name, fallback = _DEFAULTS[_value_kind(values)]
        default = node.attr(name, fallback)
    return _Lookup(keys, values, default)


@register("LabelEncoder", domain=ML, since=1)
def label_encoder_1(node, shapes, opset):
    # Opset 1 maps strings to their index in classes_strings, or indices back to the strings.
    classes = np.array(node.attr("classes_strings", []), dtype=object)
    indices = np.arange(classes.size, dtype=np.int64)
    to_index = _Lookup(classes, indices, node.attr("default_int64", -1))
    to_string = _Lookup(indices, classes, node.attr("default_string", "_Unused"))
    return lambda x: ((to_index if _is_string(x) else to_string)(x),)


@register("LabelEncoder", domain=ML, since=2)
def label_encoder_2(node, shapes, opset):
    lookup = _encoder_lookup(node, with_tensor=False)
    return lambda x: (lookup(x),)


@register("LabelEncoder", domain=ML, since=4)
def label_encoder_4(node, shapes, opset):
    # Opset 4 adds keys_tensor/values_tensor/default_tensor, which bring more element types.
    lookup = _encoder_lookup(node, with_tensor=True)
    return lambda x: (lookup(x),)


# -- TreeEnsemble ----------------------------------------------------------------------------------

_LEQ, _LT, _GTE, _GT, _EQ, _NEQ, _MEMBER = range(7)
_AVERAGE, _SUM, _MIN, _MAX = range(4)
_NONE, _SOFTMAX, _LOGISTIC, _SOFTMAX_ZERO, _PROBIT = range(5)


def _int_array(node, name: str, size: int | None = None, default=None) -> np.ndarray:
    value = node.attr(name, default)
    if value is None:
        raise graph_error(node, name, "is missing; it is required")
    array = np.asarray(value, dtype=np.int64).reshape(-1)
    if size is not None and array.size != size:
        raise graph_error(node, name, f"has {array.size} entries; expected {size}, one per node")
    return array


def _enum_attr(node, name: str, default: int, count: int) -> int:
    value = int(node.attr(name, default))
    if not 0 <= value < count:
        raise graph_error(node, name, f"is {value}; expected a value in [0, {count - 1}]")
    return value


def _membership_table(node, modes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per node, the row of its member set in a NaN-padded (sets, widest) table (-1 for others)."""
    members = node.attr("membership_values")
    member_nodes = np.flatnonzero(modes == _MEMBER)
    row = np.full(modes.size, -1, dtype=np.int64)
    if member_nodes.size == 0:
        return row, np.empty((0, 0))
    if members is None:
        raise graph_error(node, "membership_values", "is missing; BRANCH_MEMBER nodes need it")
    values = np.asarray(members, dtype=np.float64).reshape(-1)
    # Sets are NaN-delimited; a trailing NaN ends the last set rather than opening an empty one.
    sets = np.split(values, np.flatnonzero(np.isnan(values)))
    sets = [s[~np.isnan(s)] for s in sets]
    if len(sets) > member_nodes.size and sets[-1].size == 0:
        sets = sets[:-1]
    if len(sets) != member_nodes.size:
        raise graph_error(
            node,
            "membership_values",
            f"holds {len(sets)} sets; expected {member_nodes.size}, one per BRANCH_MEMBER node",
        )
    table = np.full((len(sets), max(s.size for s in sets)), np.nan)
    for i, s in enumerate(sets):
        table[i, : s.size] = s
    row[member_nodes] = np.arange(len(sets))
    return row, table


class _Forest:
    """The trees of a TreeEnsemble node. Branches are encoded as one int per node and side: a node
    index (>= 0) or ``-1 - leaf`` for a leaf, so one array holds every walk's state."""

    def __init__(self, node):
        modes = node.attr("nodes_modes")
        if modes is None:
            raise graph_error(node, "nodes_modes", "is missing; it is required")
        self.modes = np.asarray(modes, dtype=np.int64).reshape(-1)
        n = self.modes.size
        if n == 0 or self.modes.min() < _LEQ or self.modes.max() > _MEMBER:
            raise graph_error(node, "nodes_modes", "must list one mode in [0, 6] per node")
        self.features = _int_array(node, "nodes_featureids", n)
        if self.features.min() < 0:  # (numpy would index a negative one from the end)
            raise graph_error(node, "nodes_featureids", f"has {self.features.min()}; feature indices are >= 0")
        self.splits = np.asarray(node.attr("nodes_splits", []), dtype=np.float64).reshape(-1)
        if self.splits.size != n:
            raise graph_error(node, "nodes_splits", f"has {self.splits.size} entries; expected {n}, one per node")
        self.split_dtype = np.asarray(node.attr("nodes_splits")).dtype
        self.nan_true = _int_array(node, "nodes_missing_value_tracks_true", n, [0] * n).astype(bool)
        self.member_row, self.member_table = _membership_table(node, self.modes)
        self.weights = np.asarray(node.attr("leaf_weights", []), dtype=np.float64).reshape(-1)
        self.targets = _int_array(node, "leaf_targetids", self.weights.size)
        self.n_targets = int(node.attr("n_targets", int(self.targets.max(initial=-1)) + 1))
        if self.targets.size and (self.targets.min() < 0 or self.targets.max() >= self.n_targets):
            raise graph_error(node, "leaf_targetids", f"must lie in [0, {self.n_targets}) (n_targets)")
        self.true_next = self._branches(node, "true", n)
        self.false_next = self._branches(node, "false", n)
        self.roots = _int_array(node, "tree_roots")
        if self.roots.size == 0 or self.roots.min() < 0 or self.roots.max() >= n:
            raise graph_error(node, "tree_roots", f"must list at least one node index in [0, {n})")
        self.aggregate = _enum_attr(node, "aggregate_function", _SUM, 4)
        self.post_transform = _enum_attr(node, "post_transform", _NONE, 5)

    def _branches(self, node, side: str, n: int) -> np.ndarray:
        ids = _int_array(node, f"nodes_{side}nodeids", n)
        is_leaf = _int_array(node, f"nodes_{side}leafs", n).astype(bool)
        bound = np.where(is_leaf, self.weights.size, n)
        if ids.size and (ids.min() < 0 or np.any(ids >= bound)):
            raise graph_error(node, f"nodes_{side}nodeids", "points past the nodes or leaves it indexes")
        return np.where(is_leaf, -1 - ids, ids)

    def _goes_true(self, nodes: np.ndarray, values: np.ndarray, splits: np.ndarray) -> np.ndarray:
        modes, split = self.modes[nodes], splits[nodes]
        decision = np.select(
            [modes == _LEQ, modes == _LT, modes == _GTE, modes == _GT, modes == _EQ, modes == _NEQ],
            [values <= split, values < split, values >= split, values > split, values == split, values != split],
            default=False,
        )
        member = modes == _MEMBER
        if member.any():
            sets = self.member_table[self.member_row[nodes[member]]].astype(values.dtype)
            decision[member] = np.any(sets == values[member, None], axis=1)
        return np.where(np.isnan(values), self.nan_true[nodes], decision)

    def leaves(self, x: np.ndarray) -> np.ndarray:
        """The leaf each (row, tree) ends at, walking every tree one level per step."""
        if x.size and self.features.max() >= x.shape[1]:
            raise InvalidArgumentError(
                f"TreeEnsemble: input has {x.shape[1]} features; the trees read feature {self.features.max()}"
            )
        # Compare in the input's precision, so a split stored as float32 matches a float32 feature.
        splits = self.splits.astype(self.split_dtype).astype(x.dtype)
        state = np.broadcast_to(self.roots, (x.shape[0], self.roots.size)).copy()
        for _ in range(self.modes.size + 1):  # no walk is longer than the node count
            rows, trees = np.nonzero(state >= 0)
            if rows.size == 0:
                return -1 - state
            nodes = state[rows, trees]
            goes_true = self._goes_true(nodes, x[rows, self.features[nodes]], splits)
            state[rows, trees] = np.where(goes_true, self.true_next[nodes], self.false_next[nodes])
        raise InvalidArgumentError("TreeEnsemble: the trees contain a cycle; a walk did not reach a leaf")

    def scores(self, leaves: np.ndarray) -> np.ndarray:
        """Aggregate each row's leaf weights per target: (rows, n_targets), float64."""
        n_rows, n_trees = leaves.shape
        flat = (np.arange(n_rows)[:, None] * self.n_targets + self.targets[leaves]).reshape(-1)
        weights = self.weights[leaves].reshape(-1)
        size = n_rows * self.n_targets
        budget.check(size, 8, "TreeEnsemble's scores")  # n_targets: an attribute, any size
        if self.aggregate in (_SUM, _AVERAGE):
            total = np.bincount(flat, weights, minlength=size)
            out = total / n_trees if self.aggregate == _AVERAGE else total
        else:
            # Targets no leaf reached stay 0, the base value.
            ufunc, start = (np.minimum, np.inf) if self.aggregate == _MIN else (np.maximum, -np.inf)
            out = np.full(size, start)
            ufunc.at(out, flat, weights)
            out[np.bincount(flat, minlength=size) == 0] = 0
        return out.reshape(n_rows, self.n_targets)


def _softmax_rows(scores: np.ndarray, keep: np.ndarray | None = None) -> np.ndarray:
    """Softmax over each row, over the entries in ``keep`` only (the others become 0)."""
    with np.errstate(invalid="ignore", divide="ignore"):
        e = np.exp(scores - scores.max(axis=1, keepdims=True, initial=-np.inf))
        if keep is not None:
            e = np.where(keep, e, 0)
        total = e.sum(axis=1, keepdims=True)
        return np.where(total > 0, e / total, 0)


def _erfinv(y: np.ndarray) -> np.ndarray:
    """Inverse error function: Giles' single-precision approximation refined by Newton steps."""
    with np.errstate(all="ignore"):
        w = -np.log((1 - y) * (1 + y))
        central, tail = w - 2.5, np.sqrt(w) - 3
        p = np.where(w < 5, 2.81022636e-08, -0.000200214257)
        for a, b in (
            (3.43273939e-07, 0.000100950558), (-3.5233877e-06, 0.00134934322), (-4.39150654e-06, -0.00367342844),
            (0.00021858087, 0.00573950773), (-0.00125372503, -0.0076224613), (-0.00417768164, 0.00943887047),
            (0.246640727, 1.00167406), (1.50140941, 2.83297682),
        ):
            p = np.where(w < 5, a + p * central, b + p * tail)
        x = p * y
        for _ in range(2):
            x = x - (erf(x) - y) / (2 / math.sqrt(math.pi) * np.exp(-x * x))
        return np.where(np.abs(y) == 1, np.copysign(np.inf, y), x)


def _post_transform(kind: int, scores: np.ndarray) -> np.ndarray:
    if kind == _SOFTMAX:
        return _softmax_rows(scores)
    if kind == _SOFTMAX_ZERO:
        return _softmax_rows(scores, scores != 0)
    if kind == _LOGISTIC:
        return np.exp(-np.logaddexp(0, -scores))
    if kind == _PROBIT:
        return math.sqrt(2) * _erfinv(2 * scores - 1)
    return scores


@register("TreeEnsemble", domain=ML, since=5)
def tree_ensemble(node, shapes, opset):
    forest = _Forest(node)

    def kernel(x):
        if x.ndim != 2:
            raise InvalidArgumentError(f"node {node.name!r} (TreeEnsemble): input has shape {x.shape}; expected [N, F]")
        scores = forest.scores(forest.leaves(x))
        return (_post_transform(forest.post_transform, scores).astype(x.dtype),)

    return kernel


# -- ArrayFeatureExtractor, Binarizer --------------------------------------------------------------


@register("ArrayFeatureExtractor", domain=ML, since=1)
def array_feature_extractor(node, shapes, opset):
    def kernel(x, indices):
        indices = np.asarray(indices, dtype=np.int64).reshape(-1)
        width = x.shape[-1] if x.ndim else 0
        if indices.size and (indices.min() < 0 or indices.max() >= width):
            raise InvalidArgumentError(
                f"node {node.name!r} (ArrayFeatureExtractor): indices {indices.tolist()} fall outside "
                f"[0, {width}), the last axis of the input"
            )
        # A 1-D input is one row of features, so the output keeps a leading axis of 1.
        rows = x.reshape(1, -1) if x.ndim == 1 else x
        return (np.take(rows, indices, axis=-1),)

    return kernel


@register("Binarizer", domain=ML, since=1)
def binarizer(node, shapes, opset):
    threshold = float(node.attr("threshold", 0.0))
    return lambda x: ((x > threshold).astype(x.dtype),)
