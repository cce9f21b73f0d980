"""``Predictor``: a model over batches of rows, shaped for Ray Data's ``map_batches`` and Dask's ``map_partitions``.

The predictor holds only plain data (a model path or bytes, provider names and options, session options,
sizes), so it pickles as that: the session is created inside the worker on first use and kept for the
process, one per model and settings, never shipped. Ray Data constructs a callable class once per actor;
Dask pickles the instance into every task, so the per-process cache is what makes its session once per
worker too.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading

import numpy as np

from ..errors import InvalidArgumentError, ProviderNotAvailableError
from . import padding
from .sizing import MICRO_BATCH_ROWS, worker_threads

_TYPES = {"float": np.float32, "double": np.float64, "float16": np.float16, "int8": np.int8, "uint8": np.uint8,
          "int16": np.int16, "uint16": np.uint16, "int32": np.int32, "uint32": np.uint32, "int64": np.int64,
          "uint64": np.uint64, "bool": np.bool_}
_RUNTIMES = ("onnx_runtime", "onnxruntime")
_SESSIONS: dict = {}  # per process: (model identity, settings) -> session
_PREPARED: set = set()  # ids of the sessions in _SESSIONS that ran their warm-up batch
_LOCK = threading.Lock()


def _numpy_type(type_name: str, input_name: str):
    inner = type_name[len("tensor("):-1] if type_name.startswith("tensor(") else type_name
    if inner not in _TYPES:
        raise InvalidArgumentError(
            f"batch: model input {input_name!r} is {type_name}; the batch predictor feeds numeric tensors only")
    return _TYPES[inner]


def _model_identity(model) -> tuple:
    if isinstance(model, (bytes, bytearray, memoryview)):
        return ("bytes", hashlib.sha256(model).hexdigest())
    stat = os.stat(model)
    return ("path", os.path.abspath(model), stat.st_mtime_ns, stat.st_size)


def check_providers(providers) -> None:
    """Raise ProviderNotAvailableError, naming this worker, when a requested provider cannot run here: a cluster
    worker without the CUDA provider would otherwise skip it with a warning and run every row on the CPU."""
    from ..discovery import registry

    for item in providers or ():
        name = item[0] if isinstance(item, (tuple, list)) else item
        entry = registry().find(name)
        where = f"batch worker {socket.gethostname()} (pid {os.getpid()})"
        if entry is None:
            raise ProviderNotAvailableError(
                f"{where}: execution provider {name!r} is not installed here; install its distribution on every "
                f"worker (e.g. `pip install 'onnx-runtime[cuda]'`) or leave it out of the predictor's providers")
        if not entry.availability.available:
            raise ProviderNotAvailableError(
                f"{where}: execution provider {entry.name} cannot run here: {entry.availability.reason}; run this "
                f"job on workers that have it or leave it out of the predictor's providers")


def _create_session(spec: dict):
    threads = spec["intra_op_threads"] or worker_threads()
    if spec["runtime"] == "onnxruntime":
        import onnxruntime as module
    else:
        from .. import session as module
        check_providers(spec["providers"])
    options = module.SessionOptions()
    given = (spec["session_options"] or {}).get("config") or {}
    if spec["runtime"] == "onnx_runtime" and "session.compile_in_background" not in given:
        # A worker runs shards back to back for its whole life: kernels served from numpy until numba loads in
        # the background (what a short command-line run wants) cost it CPU its sibling workers need.
        options.add_session_config_entry("session.compile_in_background", "0")
    if spec["runtime"] == "onnx_runtime" and "session.graph_inputs_are_data" not in given:
        # Every model input is fed from the batch's columns, new rows at each call: the plan that prepare's
        # read-only zeros make copies them in, so the first batch runs it instead of planning again.
        options.add_session_config_entry("session.graph_inputs_are_data", "1")
    for key, value in (spec["session_options"] or {}).items():
        if key == "config":
            for entry, text in value.items():
                options.add_session_config_entry(entry, str(text))
        elif not hasattr(options, key):
            raise InvalidArgumentError(
                f"batch: session_options has {key!r}, which SessionOptions does not have; use its attribute names "
                f"(e.g. graph_optimization_level) or 'config' for session config entries")
        else:
            setattr(options, key, value)
    options.intra_op_num_threads = threads
    if spec["runtime"] == "onnxruntime":
        options.inter_op_num_threads = 1
    providers = spec["providers"] or (["CPUExecutionProvider"] if spec["runtime"] == "onnxruntime" else None)
    return module.InferenceSession(spec["model"], sess_options=options, providers=providers,
                                   provider_options=spec["provider_options"])


def worker_session(spec: dict):
    """The session for ``spec`` in this process, created on first use."""
    key = (_model_identity(spec["model"]), repr({k: v for k, v in spec.items() if k != "model"}))
    with _LOCK:
        session = _SESSIONS.get(key)
        if session is None:
            session = _SESSIONS[key] = _create_session(spec)
        return session


def sessions_here() -> list:
    """The sessions this process's predictors created (one per model and settings)."""
    with _LOCK:
        return list(_SESSIONS.values())


class Predictor:
    """Runs an ONNX model over a batch of rows and returns the batch with one column per model output.

    ``model``: a path every worker can read, or the model's bytes. ``providers`` / ``provider_options`` /
    ``session_options`` (SessionOptions attribute names, plus ``config`` for config entries) are plain data.
    ``intra_op_threads``: threads per session (default: :func:`onnx_runtime.batch.sizing.worker_threads`).
    ``batch_size``: rows per model call (default: the model's static batch size, else 32).
    ``inputs``: model input -> column (default: same names; a one-input model takes the batch's only column).
    ``keep_columns``: columns carried to the result (default: all but the model inputs).
    ``pad_value``/``pad_to``/``mask_input``: rows of different lengths are padded to the micro-batch's longest
    (``pad_to``: {input: {axis: length}} fixes a length); ``mask_input`` names a model input fed 1 over real
    elements and 0 over padding. Outputs are cut back to each row's length along padded axes.
    ``errors``: "raise" stops at the first failing row; "record" retries a failing micro-batch row by row and
    puts each failing row's message in ``error_column`` (its outputs None).
    ``runtime``: "onnx_runtime" (this runtime) or "onnxruntime" (the reference, for comparisons).
    ``prepare``: create the session and load its kernels at construction (:meth:`prepare`), so that a worker's
    first batch pays neither; pass True where the constructor runs in the worker (Ray Data's callable class,
    ``fn_constructor_kwargs``), leave it False where it runs in the driver (Dask pickles the instance)."""

    def __init__(self, model, *, providers=None, provider_options=None, session_options=None,
                 intra_op_threads: int | None = None, batch_size: int | None = None, inputs: dict | None = None,
                 outputs: list | None = None, keep_columns=None, pad_value=0, pad_to: dict | None = None,
                 mask_input: str | None = None, errors: str = "raise", error_column: str = "error",
                 runtime: str = "onnx_runtime", prepare: bool = False):
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        if not isinstance(model, (str, bytes)):
            raise InvalidArgumentError(
                f"batch: model is {type(model).__name__}; pass a path every worker can read or the model's bytes "
                f"(a session is created in each worker, never pickled)")
        for name, value in (("intra_op_threads", intra_op_threads), ("batch_size", batch_size)):
            if value is not None and (not isinstance(value, int) or value < 1):
                raise InvalidArgumentError(f"batch: {name} must be a positive integer or None, got {value!r}")
        if errors not in ("raise", "record"):
            raise InvalidArgumentError(f"batch: errors is {errors!r}; use 'raise' or 'record'")
        if runtime not in _RUNTIMES:
            raise InvalidArgumentError(f"batch: runtime is {runtime!r}; use one of {_RUNTIMES}")
        self._spec = {"model": model, "providers": providers, "provider_options": provider_options,
                      "session_options": session_options, "intra_op_threads": intra_op_threads, "runtime": runtime}
        self.batch_size, self.inputs, self.outputs = batch_size, dict(inputs or {}), outputs
        self.keep_columns, self.pad_value, self.pad_to = keep_columns, pad_value, dict(pad_to or {})
        self.mask_input, self.errors, self.error_column = mask_input, errors, error_column
        self._session = None
        if prepare:
            self.prepare()

    def prepare(self) -> None:
        """Create this process's session and run it once on a micro-batch of zeros where every input's per-row
        shape is static, read-only as a data set's columns are, so the plan is made and its kernels (numba's
        import, the cached machine code the plan links) are loaded now rather than inside the first batch.
        Once per session and process. A model that refuses zeros (or has dynamic per-row shapes) loads at its
        first real batch instead, where a real error is reported with its rows."""
        sess = self.session
        with _LOCK:
            if id(sess) in _PREPARED:
                return
        feeds = self._warm_feeds(sess)
        if feeds is not None:
            try:
                sess.run(self.outputs or [arg.name for arg in sess.get_outputs()], feeds)
            except Exception:  # noqa: BLE001 (zeros are not the data: its first batch reports a real error)
                pass
        with _LOCK:
            _PREPARED.add(id(sess))

    def _warm_feeds(self, sess) -> dict | None:
        args = {arg.name: arg for arg in sess.get_inputs()}
        step = self._step(args)
        feeds = {}
        for name, arg in args.items():
            shape = list(arg.shape or [])
            rows = shape[0] if shape and isinstance(shape[0], int) and shape[0] > 0 else step
            if not shape or not all(isinstance(d, int) and d > 0 for d in shape[1:]):
                return None
            try:
                dtype = _numpy_type(arg.type, name)
            except InvalidArgumentError:
                return None
            value = np.zeros([rows, *shape[1:]], dtype=dtype)
            if name == self.mask_input:
                value[...] = 1
            value.setflags(write=False)
            feeds[name] = value
        return feeds

    def __getstate__(self):
        state = dict(self.__dict__)
        state["_session"] = None  # sessions stay in their process
        return state

    @property
    def session(self):
        if self._session is None:
            self._session = worker_session(self._spec)
        return self._session

    # -- batches --------------------------------------------------------------------------------------------
    def __call__(self, batch):
        """A Ray Data batch (dict of numpy arrays, pandas DataFrame or pyarrow Table) or a Dask partition (a
        pandas DataFrame): the same kind back, with the kept columns and one column per output."""
        kind, columns = _columns_of(batch)
        n = _row_count(columns)
        results, failures = self.predict(columns, n)
        feeds = set(self._input_columns(columns).values())
        keep = self.keep_columns
        kept = {k: v for k, v in columns.items()
                if (keep is True or (keep is None and k not in feeds) or (isinstance(keep, (list, tuple))
                                                                          and k in keep))}
        kept.update(results)
        if self.errors == "record":
            kept[self.error_column] = np.array([failures.get(i) for i in range(n)], dtype=object)
        return _as_kind(kind, kept, batch)

    def _input_columns(self, columns: dict) -> dict:
        mapping = {}
        graph_inputs = [arg.name for arg in self.session.get_inputs() if arg.name != self.mask_input]
        for name in graph_inputs:
            column = self.inputs.get(name, name)
            if column not in columns and len(graph_inputs) == 1 and name not in self.inputs:
                free = [c for c in columns if c not in (self.keep_columns or ())]
                if len(free) == 1:
                    column = free[0]
            if column not in columns:
                raise InvalidArgumentError(
                    f"batch: model input {name!r} has no column {column!r} in the batch (columns: "
                    f"{sorted(columns)}); map it with inputs={{{name!r}: 'COLUMN'}}")
            mapping[name] = column
        return mapping

    def predict(self, columns: dict, n: int, row_ids=None) -> tuple[dict, dict]:
        """``(outputs, failures)`` for ``n`` rows: outputs maps each output name to an array (rows along axis 0)
        or, where row shapes differ or rows failed, an object array of per-row arrays (None where failed);
        failures maps row positions to messages (only with errors='record')."""
        sess = self.session
        args = {arg.name: arg for arg in sess.get_inputs()}
        names = self.outputs or [arg.name for arg in sess.get_outputs()]
        mapping = self._input_columns(columns)
        ids = list(range(n)) if row_ids is None else list(row_ids)
        step = self._step(args)
        dense = self._dense_feeds(args, mapping, columns, n)
        rows = None if dense is not None else self._rows(columns, mapping)
        blocks: list[tuple[range, list[np.ndarray]]] = []  # dense micro-batches' outputs, rows along axis 0
        per_row: dict[str, list] | None = None if dense is not None else {name: [None] * n for name in names}
        failures: dict[int, str] = {}
        for start in range(0, n, step):
            chunk = range(start, min(n, start + step))
            try:
                if dense is not None:
                    blocks.append((chunk, self._run_dense(sess, names, dense, chunk)))
                    continue
                self._run_chunk(sess, args, names, rows, chunk, ids, per_row)
            except Exception:
                if self.errors == "raise":
                    raise
                if per_row is None:  # leave the dense path: the failing rows are found one by one below
                    rows, per_row = self._rows(columns, mapping), self._unblock(names, blocks, n)
                    dense, blocks = None, []
                for i in chunk:  # find the failing rows: the others still get their outputs
                    try:
                        self._run_chunk(sess, args, names, rows, range(i, i + 1), ids, per_row)
                    except Exception as exc:
                        failures[i] = f"{type(exc).__name__}: {exc}"
        if per_row is None:
            joined = {name: _concatenate([outputs[k] for _, outputs in blocks]) for k, name in enumerate(names)}
            if all(value is not None for value in joined.values()):
                return joined, failures
            per_row = self._unblock(names, blocks, n)
        return {name: _stack(values) for name, values in per_row.items()}, failures

    def _rows(self, columns: dict, mapping: dict) -> dict:
        return {name: padding.column_rows(columns[column], name) for name, column in mapping.items()}

    @staticmethod
    def _unblock(names: list, blocks: list, n: int) -> dict[str, list]:
        per_row: dict[str, list] = {name: [None] * n for name in names}
        for chunk, outputs in blocks:
            for name, value in zip(names, outputs):
                for j, i in enumerate(chunk):
                    per_row[name][i] = value[j]
        return per_row

    def _dense_feeds(self, args: dict, mapping: dict, columns: dict, n: int) -> dict | None:
        """Each input's whole column as one array of the model's dtype, rows along axis 0 (a flat row reshaped
        to a static per-row shape: views, no per-row work), when every column is a numeric array that needs no
        padding and the batch axis is dynamic; None sends the batch the general way (per-row arrays, padding,
        static batches, masks)."""
        if self.mask_input is not None or not mapping:
            return None
        feeds = {}
        for name, column in mapping.items():
            arg, data = args[name], columns[column]
            if not isinstance(data, np.ndarray) or data.dtype == object or data.ndim == 0 or len(data) != n \
                    or self.pad_to.get(name) or not arg.shape or isinstance(arg.shape[0], int):
                return None
            shape = list(arg.shape[1:])
            if data.ndim - 1 == len(shape) and all(not isinstance(d, int) or d == s for d, s in
                                                     zip(shape, data.shape[1:])):
                pass
            elif all(isinstance(d, int) and d > 0 for d in shape) and \
                    int(np.prod(data.shape[1:], dtype=np.int64)) == int(np.prod(shape, dtype=np.int64)):
                data = data.reshape([n, *shape])
            else:
                return None  # the general path names the row that does not fit
            feeds[name] = data.astype(_numpy_type(arg.type, name), copy=False)
        return feeds

    @staticmethod
    def _run_dense(sess, names: list, feeds: dict, chunk: range) -> list[np.ndarray]:
        results = sess.run(names, {name: value[chunk.start:chunk.stop] for name, value in feeds.items()})
        outputs = [np.asarray(value) for value in results]
        for name, value in zip(names, outputs):
            if value.ndim == 0 or len(value) < len(chunk):
                raise InvalidArgumentError(
                    f"batch: output {name!r} has shape {list(value.shape)} for {len(chunk)} rows; the predictor "
                    f"splits outputs into rows along axis 0, so name per-row outputs with outputs=[...]")
        return [value[:len(chunk)] for value in outputs]

    def _step(self, args: dict) -> int:
        static = {arg.shape[0] for arg in args.values() if arg.shape and isinstance(arg.shape[0], int)}
        if len(static) == 1 and min(static) > 0:
            fixed = static.pop()
            return min(fixed, self.batch_size or fixed) if fixed == 1 else fixed
        return self.batch_size or MICRO_BATCH_ROWS

    def _run_chunk(self, sess, args, names, rows, chunk, ids, per_row) -> None:
        feeds, lengths = {}, None
        for name, column in rows.items():
            arg = args[name]
            shape = list(arg.shape[1:]) if arg.shape else []
            picked = [padding.fit_row(column[i], shape, name, ids[i]) for i in chunk]
            axes = {axis: length for axis, length in self.pad_to.get(name, {}).items()}
            feeds[name], own = padding.stack_rows(picked, name, _numpy_type(arg.type, name), self.pad_value, axes)
            if own is not None:
                lengths = (feeds[name].shape[1:], own)
        fixed = args[next(iter(rows))].shape[0] if rows else None
        count = len(chunk)
        if isinstance(fixed, int) and fixed > count:  # a static batch: fill with the last row, drop its outputs
            feeds = {k: np.concatenate([v, np.repeat(v[-1:], fixed - count, axis=0)]) for k, v in feeds.items()}
        if self.mask_input is not None:
            arg = args[self.mask_input]
            first = next(iter(feeds.values()))
            own = lengths[1] if lengths is not None else np.array([list(first.shape[1:])] * len(first))
            if len(own) < len(first):
                own = np.concatenate([own, np.repeat(own[-1:], len(first) - len(own), axis=0)])
            feeds[self.mask_input] = padding.padding_mask(own, first.shape, _numpy_type(arg.type, arg.name))
        results = sess.run(names, feeds)
        for name, value in zip(names, results):
            value = np.asarray(value)
            for j, i in enumerate(chunk):
                row = value[j]
                if lengths is not None:
                    row = padding.trim_output(row, lengths[0], lengths[1][j])
                per_row[name][i] = row


def _concatenate(blocks: list):
    """The micro-batches' outputs as one array, or None where their per-row shapes or types differ."""
    if not blocks or len({(b.shape[1:], b.dtype) for b in blocks}) > 1:
        return None
    return np.concatenate(blocks) if len(blocks) > 1 else blocks[0]


def _stack(values: list):
    if all(v is not None for v in values) and len({(v.shape, v.dtype) for v in values}) <= 1 and values:
        return np.stack(values)
    out = np.empty(len(values), dtype=object)
    out[:] = [None] * len(values)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _row_count(columns: dict) -> int:
    counts = {len(v) for v in columns.values()}
    if len(counts) > 1:
        raise InvalidArgumentError(f"batch: columns have different row counts {sorted(counts)}")
    return counts.pop() if counts else 0


def _columns_of(batch) -> tuple[str, dict]:
    if isinstance(batch, dict):
        return "dict", dict(batch)
    module = type(batch).__module__.split(".")[0]
    if module == "pandas":
        return "pandas", {str(c): batch[c].to_numpy() for c in batch.columns}
    if module == "pyarrow":
        return "pyarrow", {name: batch.column(name).to_numpy(zero_copy_only=False) for name in batch.column_names}
    raise InvalidArgumentError(
        f"batch: a batch is a dict of numpy arrays, a pandas DataFrame or a pyarrow Table, got {type(batch).__name__}")


def _as_kind(kind: str, columns: dict, batch):
    if kind == "dict":
        return columns
    if kind == "pandas":
        import pandas as pd

        data = {k: (list(v) if isinstance(v, np.ndarray) and v.ndim > 1 else v) for k, v in columns.items()}
        return pd.DataFrame(data, index=batch.index)
    import pyarrow as pa

    arrays = {}
    for name, value in columns.items():
        if isinstance(value, np.ndarray) and value.ndim > 1:
            arrays[name] = pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(value))
        elif isinstance(value, np.ndarray) and value.dtype == object:
            arrays[name] = pa.array([None if v is None else np.asarray(v).ravel() for v in value])
        else:
            arrays[name] = pa.array(value)
    return pa.table(arrays)
