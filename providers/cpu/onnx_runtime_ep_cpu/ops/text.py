"""Text kernels: StringSplit, StringNormalizer, StringConcat, RegexFullMatch and TfIdfVectorizer.

String tensors are numpy object arrays of Python ``str``. Per-string work (splitting, case
changes, regex matching) necessarily runs in Python; TfIdfVectorizer maps tokens to vocabulary
ids once and then matches every n-gram window with numpy lookups.
"""

from __future__ import annotations

import re

import numpy as np
from onnx_runtime import budget
from onnx_runtime.errors import InvalidArgumentError

from ..registry import register
from ._common import graph_error


def _strings(values, shape) -> np.ndarray:
    """An object array of ``shape`` holding ``values`` (np.array would nest lists of strings)."""
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out.reshape(shape)


# -- StringSplit ---------------------------------------------------------------------------------


@register("StringSplit", since=20)
def string_split(node, shapes, opset):
    # An unset or empty delimiter splits on runs of whitespace, which is str.split(None).
    delimiter = node.attr("delimiter") or None
    maxsplit = node.attr("maxsplit")
    maxsplit = -1 if maxsplit is None else int(maxsplit)
    if maxsplit < -1:
        raise graph_error(node, "maxsplit", f"is {maxsplit}; expected a non-negative count")

    def kernel(x):
        parts = [str(s).split(delimiter, maxsplit) for s in x.reshape(-1)]
        lengths = np.array([len(p) for p in parts], dtype=np.int64).reshape(x.shape)
        width = max((len(p) for p in parts), default=0)
        padded = [p + [""] * (width - len(p)) for p in parts]
        return _strings([s for p in padded for s in p], x.shape + (width,)), lengths

    return kernel


# -- StringNormalizer ----------------------------------------------------------------------------

_CASE_ACTIONS = {"NONE": None, "LOWER": str.lower, "UPPER": str.upper}


@register("StringNormalizer", since=10)
def string_normalizer(node, shapes, opset):
    action = node.attr("case_change_action", "NONE") or "NONE"
    if action not in _CASE_ACTIONS:
        raise graph_error(node, "case_change_action", f"is {action!r}; expected one of {', '.join(_CASE_ACTIONS)}")
    change = _CASE_ACTIONS[action]
    case_sensitive = bool(int(node.attr("is_case_sensitive", 0)))
    # Case changes follow Unicode rules (Python's str methods), whatever the locale attribute says.
    fold = (lambda s: s) if case_sensitive else str.lower
    stopwords = {fold(str(w)) for w in node.attr("stopwords") or []}

    def kernel(x):
        if x.ndim not in (1, 2) or (x.ndim == 2 and x.shape[0] != 1):
            raise InvalidArgumentError(
                f"node {node.name!r} (StringNormalizer): input shape {x.shape} is not supported; expected [C] or [1, C]"
            )
        kept = [str(s) for s in x.reshape(-1) if fold(str(s)) not in stopwords]
        if change is not None:
            kept = [change(s) for s in kept]
        if not kept:
            kept = [""]  # everything was a stopword: one empty string, as the spec requires
        return (_strings(kept, (len(kept),) if x.ndim == 1 else (1, len(kept))),)

    return kernel


# -- StringConcat --------------------------------------------------------------------------------


@register("StringConcat", since=20)
def string_concat(node, shapes, opset):
    # Object arrays add elementwise with Python's str +, broadcasting as numpy does.
    return lambda x, y: (np.asarray(np.add(x, y), dtype=object),)


# -- RegexFullMatch ------------------------------------------------------------------------------

# RE2's ASCII POSIX classes, spelled as Python character-class contents.
_POSIX_CLASSES = {
    "alnum": "0-9A-Za-z", "alpha": "A-Za-z", "ascii": "\\x00-\\x7f", "blank": "\\t ",
    "cntrl": "\\x00-\\x1f\\x7f", "digit": "0-9", "graph": "!-~", "lower": "a-z", "print": " -~",
    "punct": "!-/:-@\\[-`{-~", "space": "\\t\\n\\v\\f\\r ", "upper": "A-Z", "word": "0-9A-Za-z_",
    "xdigit": "0-9A-Fa-f",
}
_POSIX_CLASS = re.compile(r"\[:(\w+):\]")


def _re2_to_python(pattern: str) -> str:
    """Rewrite the RE2 spellings Python's ``re`` lacks: ``\\z``, ``\\Q...\\E`` and POSIX classes
    such as ``[[:alpha:]]``. The rest of RE2's syntax means the same in Python."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt == "Q":
                end = pattern.find("\\E", i + 2)
                end = len(pattern) if end < 0 else end
                out.append(re.escape(pattern[i + 2:end]))
                i = end + 2
                continue
            out.append("\\Z" if nxt == "z" else pattern[i:i + 2])
            i += 2
            continue
        if in_class:
            posix = _POSIX_CLASS.match(pattern, i)
            if posix and posix.group(1) in _POSIX_CLASSES:
                out.append(_POSIX_CLASSES[posix.group(1)])
                i = posix.end()
                continue
            in_class = c != "]"
        elif c == "[":
            in_class = True
            # A leading ']' (after an optional '^') is a literal, not the end of the class.
            start = i + 1 + (pattern.startswith("^", i + 1))
            if pattern.startswith("]", start):
                out.append(pattern[i:start + 1])
                i = start + 1
                continue
        out.append(c)
        i += 1
    return "".join(out)


@register("RegexFullMatch", since=20)
def regex_full_match(node, shapes, opset):
    pattern = node.attr("pattern")
    if pattern is None:
        raise graph_error(node, "pattern", "is missing; RegexFullMatch requires a pattern")
    try:
        # RE2's \w, \d, \s and \b are ASCII classes.
        regex = re.compile(_re2_to_python(pattern), re.ASCII)
    except re.error as exc:
        raise graph_error(node, "pattern", f"{pattern!r} is not a valid regular expression ({exc})") from None

    def kernel(x):
        matches = [regex.fullmatch(str(s)) is not None for s in x.reshape(-1)]
        return (np.array(matches, dtype=np.bool_).reshape(x.shape),)

    return kernel


# -- TfIdfVectorizer -----------------------------------------------------------------------------

_TFIDF_MODES = ("TF", "IDF", "TFIDF")


def _lookup(keys: np.ndarray, queries: np.ndarray) -> np.ndarray:
    """The position of each query in sorted ``keys``, or -1 where it is absent."""
    if keys.size == 0:
        return np.full(queries.shape, -1, dtype=np.int64)
    pos = np.searchsorted(keys, queries)
    clipped = np.minimum(pos, keys.size - 1)
    return np.where((pos < keys.size) & (keys[clipped] == queries), clipped, -1)


class _NgramLevel:
    """The pool's n-grams of one length n, encoded for vectorized lookup.

    Tokens are vocabulary ids; an n-gram's code is built one token at a time, each step
    compacting (previous code, next token id) pairs with ``np.unique`` so codes stay below
    pool size times vocabulary size and never overflow. ``owner[code]`` is the pool n-gram id.
    """

    def __init__(self, ngrams: np.ndarray, first_id: int, vocab_size: int):
        self.vocab_size = vocab_size
        self.steps: list[np.ndarray] = []  # the sorted pair keys of each compaction step
        codes = ngrams[:, 0]
        space = vocab_size
        for j in range(1, ngrams.shape[1]):
            keys, codes = np.unique(codes * vocab_size + ngrams[:, j], return_inverse=True)
            self.steps.append(keys)
            space = keys.size
        self.owner = np.full(space, -1, dtype=np.int64)
        # Reversed so that a duplicated n-gram belongs to its first pool entry.
        self.owner[codes[::-1]] = np.arange(first_id, first_id + len(ngrams))[::-1]

    def match(self, windows: np.ndarray) -> np.ndarray:
        """Pool n-gram id of each (..., n) window of token ids (-1: not in the vocabulary), or -1."""
        codes = windows[..., 0]
        valid = codes >= 0
        for j, keys in enumerate(self.steps, start=1):
            token = windows[..., j]
            valid &= token >= 0
            codes = _lookup(keys, np.where(valid, codes, 0) * self.vocab_size + token)
            valid &= codes >= 0
        return np.where(valid, self.owner[np.where(valid, codes, 0)], -1)


class _TfIdfSpec:
    """The TfIdfVectorizer attributes, validated, with the pool encoded per n-gram length."""

    def __init__(self, node):
        self.node = node
        self.mode = node.attr("mode")
        if self.mode not in _TFIDF_MODES:
            raise graph_error(node, "mode", f"is {self.mode!r}; expected one of {', '.join(_TFIDF_MODES)}")
        self.min_n = int(node.attr("min_gram_length", 1))
        self.max_n = int(node.attr("max_gram_length", 1))
        if not 1 <= self.min_n <= self.max_n:
            raise graph_error(
                node, "min_gram_length", f"is {self.min_n} with max_gram_length {self.max_n}; expected 1 <= min <= max"
            )
        self.max_skip = int(node.attr("max_skip_count", 0))
        if self.max_skip < 0:
            raise graph_error(node, "max_skip_count", f"is {self.max_skip}; expected a non-negative count")
        pool = self._pool()
        self.strings = pool.dtype == object
        self.vocab = np.unique(pool)
        self.indexes = np.asarray(node.attr("ngram_indexes", []), dtype=np.int64).reshape(-1)
        self.levels, self.pool_ngrams = self._levels(pool)
        total = self.pool_ngrams
        if self.indexes.size != total or (self.indexes < 0).any():
            raise graph_error(
                node, "ngram_indexes", f"has {self.indexes.size} entries; expected {total} non-negative output "
                "positions, one per n-gram of the pool"
            )
        self.width = int(self.indexes.max()) + 1 if self.indexes.size else 0
        # The spec calls weights[i] the weight of the pool's i-th n-gram, but ONNX Runtime (and the
        # converters that emit this op, such as skl2onnx) apply weights[j] to output position j;
        # the two agree whenever ngram_indexes is the identity. Follow ONNX Runtime.
        weights = node.attr("weights")
        self.weights = None if weights is None else np.asarray(weights, dtype=np.float32).reshape(-1)
        if self.weights is not None and (self.weights.size != total or self.width > total):
            raise graph_error(
                node, "weights", f"has {self.weights.size} entries for {total} n-grams and {self.width} output "
                "positions; expected one weight per n-gram, with ngram_indexes below that count"
            )

    def _pool(self) -> np.ndarray:
        strings, ints = self.node.attr("pool_strings"), self.node.attr("pool_int64s")
        if (strings is None) == (ints is None):
            raise graph_error(self.node, "pool_strings", "and pool_int64s: exactly one of them must be set")
        if strings is not None:
            return _strings([str(s) for s in strings], (len(strings),))
        return np.asarray(ints, dtype=np.int64).reshape(-1)

    def _levels(self, pool: np.ndarray) -> tuple[dict[int, _NgramLevel], int]:
        """n -> the pool's n-grams of the lengths counted, from ngram_counts (the pool offset where
        each length starts); and how many n-grams the pool holds."""
        starts = [int(c) for c in self.node.attr("ngram_counts", [])]
        bounds = starts + [pool.size]
        if any(a > b for a, b in zip(bounds, bounds[1:])) or (starts and starts[0] < 0):
            raise graph_error(self.node, "ngram_counts", f"is {starts}; expected ascending offsets into the pool")
        ids = _lookup(self.vocab, pool)
        levels, count = {}, 0
        for n, (start, stop) in enumerate(zip(bounds, bounds[1:]), start=1):
            if (stop - start) % n:
                raise graph_error(
                    self.node, "ngram_counts", f"gives {stop - start} pool entries to {n}-grams; not a multiple of {n}"
                )
            ngrams = ids[start:stop].reshape(-1, n)
            if len(ngrams) and self.min_n <= n <= self.max_n:
                levels[n] = _NgramLevel(ngrams, count, max(self.vocab.size, 1))
            count += len(ngrams)
        return levels, count

    def counts(self, tokens: np.ndarray) -> np.ndarray:
        """(rows, pool n-grams) occurrence counts over (rows, C) vocabulary ids."""
        rows, length = tokens.shape
        found = []
        for n, level in self.levels.items():
            # A 1-gram is the same for every skip, so it is counted once.
            for skip in range(self.max_skip + 1 if n > 1 else 1):
                step = skip + 1
                starts = length - (n - 1) * step
                if starts <= 0:
                    break
                windows = np.stack([tokens[:, j * step:j * step + starts] for j in range(n)], axis=-1)
                found.append(level.match(windows))
        counts = np.zeros((rows, self.pool_ngrams), dtype=np.float32)
        for ids in found:
            row, col = np.nonzero(ids >= 0)
            np.add.at(counts, (row, ids[row, col]), 1)
        return counts


@register("TfIdfVectorizer", since=9)
def tfidf_vectorizer(node, shapes, opset):
    spec = _TfIdfSpec(node)

    def kernel(x):
        if (x.dtype == object) != spec.strings or x.ndim not in (1, 2):
            raise InvalidArgumentError(
                f"node {node.name!r} (TfIdfVectorizer): input {x.dtype} {x.shape} does not fit a "
                f"{'string' if spec.strings else 'int64'} pool; expected a matching 1-D or 2-D tensor"
            )
        rows = x.reshape(1, -1) if x.ndim == 1 else x
        tokens = _lookup(spec.vocab, rows.astype(object if spec.strings else np.int64))
        budget.check(rows.shape[0] * spec.width, 4, "TfIdfVectorizer's output")  # width: the largest ngram index
        counts = spec.counts(tokens)
        y = np.zeros((rows.shape[0], spec.width), dtype=np.float32)
        np.add.at(y, (slice(None), spec.indexes), counts)
        if spec.mode == "IDF":
            y = np.minimum(y, 1)
        if spec.mode != "TF" and spec.weights is not None:
            y *= spec.weights[: spec.width]
        return (y.reshape(-1) if x.ndim == 1 else y,)

    return kernel
