"""A persistent cache of session plans: the optimized graph of a model and its per-signature specializations.

Creating a session checks the model, infers its shapes, runs the optimizer and the providers' passes; its first
run at a new input signature infers and folds again (session/specialize.py). A second process creating the same
model with the same options and providers repeats all of it. This cache keeps what those steps produce, as ONNX
protobuf (serialize.py's writer, read back by ``loader.graph_from_plan``) with a JSON header, in one file per
(plan key, part) under a user cache folder:

- part ``graph``: the graph after the optimizer and the providers' passes (before placement), the model as shape
  inference read it (what specialization infers over) and the small constants creation folded;
- part ``sig-<digest>``: the graph specialized to one input signature, after its passes.

Weights the model holds are not written again: an initializer that is still the array the loader read is stored
as a reference by name and taken from the model when the plan is read. Placement and kernels are made anew
(cheap, and they hold live objects).

The key hashes everything a plan depends on: the model file's bytes (and the size and time of its external data
files), the session options and config entries, the providers (names, options, distribution versions), the
versions of Python, numpy and onnx, a fingerprint of the installed code (size and time of every module of the
runtime and of each provider's package), the host's CPU flags and every ``ONNX_RUNTIME_*`` variable. A file is
read only when its header names the same key and part and the payload's SHA-256 matches: a corrupt, truncated
or foreign file is ignored with a warning (and removed), never run. Writes go to a temporary file renamed into
place (concurrent writers leave one whole file); the folder is pruned, oldest first, past its size bound.

Off with ``ONNX_RUNTIME_PLAN_CACHE=0`` or the session config entry ``session.plan_cache`` = "0"; the folder is
``session.plan_cache_dir`` or ``ONNX_RUNTIME_PLAN_CACHE_DIR`` (default ``$XDG_CACHE_HOME/onnx_runtime/plans``,
``~/.cache`` without it), bounded by ``ONNX_RUNTIME_PLAN_CACHE_MB`` (default 256). docs/cold-start.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import sys
import tempfile
import warnings

import numpy as np
import onnx

from .cpus import cpu_flags_line
from .errors import InvalidArgumentError
from .loader import model_bytes
from .package_finder import LOADED_STATS

ENABLE_KEY = "session.plan_cache"  # "0": this session neither reads nor writes plans
DIR_KEY = "session.plan_cache_dir"
ENV_ENABLE = "ONNX_RUNTIME_PLAN_CACHE"
ENV_DIR = "ONNX_RUNTIME_PLAN_CACHE_DIR"
ENV_LIMIT = "ONNX_RUNTIME_PLAN_CACHE_MB"
DEFAULT_LIMIT_MB = 256
FORMAT = 1  # bumped when what a part holds changes
MAGIC = b"onnx-runtime plan\n"
PRUNE_EVERY = 16  # the folder is pruned at a process's first write and every 16 writes after it
_writes = 0
_unwritable: set[str] = set()  # folders a write failed in (warned about once)
SUFFIX = ".plan"


class PlanCache:
    """The plans of one (model, options, providers) key in one folder."""

    def __init__(self, directory: str, key: str, limit_bytes: int, path: str | None = None, digest: str = ""):
        self.directory = directory
        self.key = key
        self.limit_bytes = limit_bytes
        self._path, self._digest = path, digest  # a model file, checked again before a write (see store)
        # The most a plan's own arrays (weights the passes made) may take: a quarter of the folder's bound.
        self.max_plan_bytes = limit_bytes // 4

    def path(self, part: str) -> str:
        return os.path.join(self.directory, f"{self.key[:32]}-{part}{SUFFIX}")

    def load(self, part: str) -> tuple[dict, dict[str, bytes]] | None:
        """(meta, sections) of ``part``, or None when absent; a file that fails its checks is removed."""
        path = self.path(part)
        try:
            with open(path, "rb") as handle:
                data = handle.read()
        except OSError:
            return None
        try:
            meta, sections = _decode(data, self.key, part)
        except ValueError as exc:
            warnings.warn(f"onnx-runtime: ignoring plan cache file {path!r}: {exc}", RuntimeWarning, stacklevel=3)
            _remove(path)
            return None
        try:
            os.utime(path)  # read recently: pruned last
        except OSError:
            pass
        return meta, sections

    def store(self, part: str, meta: dict, sections: dict[str, bytes]) -> None:
        """Write ``part`` atomically (a temporary file renamed over it), then prune the folder to its bound. A
        folder that cannot be written costs a warning, never the session."""
        if self._path is not None and source_digest(self._path) != self._digest:
            return  # the file changed since the key was made: what was planned may be of other bytes
        data = _encode(self.key, part, meta, sections)
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            fd, temporary = tempfile.mkstemp(prefix=".writing-", suffix=SUFFIX, dir=self.directory)
            try:
                with os.fdopen(fd, "wb") as handle:
                    handle.write(data)
                os.replace(temporary, self.path(part))
            except BaseException:
                _remove(temporary)
                raise
            global _writes
            _writes += 1
            if (_writes - 1) % PRUNE_EVERY == 0:  # a scan of the folder costs ms with hundreds of plans in it
                prune(self.directory, self.limit_bytes)
        except OSError as exc:
            if self.directory not in _unwritable:  # once per folder and process: a read-only home is common
                _unwritable.add(self.directory)
                warnings.warn(f"onnx-runtime: the plan cache in {self.directory!r} could not be written ({exc}); "
                              f"set {ENV_DIR} to a writable folder or {ENV_ENABLE}=0", RuntimeWarning, stacklevel=3)


def _encode(key: str, part: str, meta: dict, sections: dict[str, bytes]) -> bytes:
    header = {"format": FORMAT, "key": key, "part": part, "meta": meta,
              "sections": [[name, len(body), hashlib.sha256(body).hexdigest()] for name, body in sections.items()]}
    head = json.dumps(header, sort_keys=True).encode()
    return MAGIC + len(head).to_bytes(8, "little") + head + b"".join(sections.values())


def _decode(data: bytes, key: str, part: str) -> tuple[dict, dict[str, bytes]]:
    if not data.startswith(MAGIC):
        raise ValueError("not a plan file")
    start = len(MAGIC) + 8
    size = int.from_bytes(data[len(MAGIC):start], "little")
    try:
        header = json.loads(data[start:start + size])
    except ValueError as exc:
        raise ValueError(f"unreadable header ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError("written by another format version")
    if header.get("key") != key or header.get("part") != part:
        raise ValueError("written for another model, options or code (its key differs)")
    sections: dict[str, bytes] = {}
    offset = start + size
    for name, length, digest in header.get("sections", []):
        body = data[offset:offset + length]
        if len(body) != length or hashlib.sha256(body).hexdigest() != digest:
            raise ValueError(f"section {name!r} is truncated or corrupt (its SHA-256 does not match)")
        sections[name] = body
        offset += length
    if offset != len(data):
        raise ValueError("trailing bytes after the last section")
    return header.get("meta", {}), sections


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def prune(directory: str, limit_bytes: int) -> None:
    """Remove the least recently used plan files of ``directory`` until it holds at most ``limit_bytes``
    (temporary files of writers that died are removed once an hour old)."""
    entries = []
    try:
        with os.scandir(directory) as scan:
            for entry in scan:
                if entry.name.endswith(SUFFIX) and entry.is_file(follow_symlinks=False):
                    stat = entry.stat(follow_symlinks=False)
                    entries.append((stat.st_mtime, stat.st_size, entry.path, entry.name.startswith(".writing-")))
    except OSError:
        return
    total = sum(size for _, size, _, _ in entries)
    import time
    for mtime, size, path, writing in sorted(entries):
        if writing and time.time() - mtime < 3600:
            continue  # another process is writing it
        if total <= limit_bytes and not writing:
            break
        _remove(path)
        total -= size


def open_cache(config: dict[str, str], source, handles) -> PlanCache | None:
    """The plan cache of a session with ``config`` (session_config's entries) creating from ``source`` on
    ``handles``, or None: turned off, or a source the cache does not key (an ``onnx.ModelProto``)."""
    if os.environ.get(ENV_ENABLE, "1") == "0" or config.get(ENABLE_KEY, "1") == "0":
        return None
    digest = source_digest(source, keep=True)
    if digest is None:
        return None
    directory = config.get(DIR_KEY) or os.environ.get(ENV_DIR) or default_directory()
    path = os.fspath(source) if isinstance(source, (str, os.PathLike)) else None
    return PlanCache(directory, plan_key(digest, config, handles), limit_bytes(), path, digest)


def limit_bytes() -> int:
    text = os.environ.get(ENV_LIMIT, str(DEFAULT_LIMIT_MB))
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise InvalidArgumentError(f"{ENV_LIMIT}={text!r} is not a size in MB; set a number >= 0 (default "
                                   f"{DEFAULT_LIMIT_MB}), or {ENV_ENABLE}=0 to turn the plan cache off")
    return int(value * (1 << 20))


def default_directory() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "onnx_runtime", "plans")


def source_digest(source, keep: bool = False) -> str | None:
    """SHA-256 of the model's bytes (a path's file, plus the size and time of the external data files beside it
    that the model may name), or None for what is not a path or bytes. ``keep``: the file's bytes are held for
    the loader's parse of the same creation (loader.model_bytes), which then reads the file no second time."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        return hashlib.sha256(source).hexdigest()
    if not isinstance(source, (str, os.PathLike)):
        return None
    path = os.fspath(source)
    try:
        data = model_bytes(path, keep)
    except OSError:
        return None  # the loader says what is wrong with the path
    digest = hashlib.sha256(data)
    if b"location" in data:  # external data: its files' sizes and times join the key
        folder = os.path.dirname(os.path.abspath(path))
        for name in sorted(_external_locations(data)):
            try:
                stat = os.stat(os.path.join(folder, name))
                digest.update(f"\0{name}\0{stat.st_size}\0{stat.st_mtime_ns}".encode())
            except OSError:
                digest.update(f"\0{name}\0missing".encode())
    return digest.hexdigest()


def _external_locations(data: bytes) -> set[str]:
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except Exception:
        return set()
    found: set[str] = set()
    graphs = [proto.graph]
    while graphs:
        graph = graphs.pop()
        tensors = list(graph.initializer) + [sparse.values for sparse in graph.sparse_initializer]
        for node in graph.node:
            for attribute in node.attribute:
                tensors.extend([attribute.t, *attribute.tensors])
                graphs.extend([attribute.g, *attribute.graphs] if attribute.HasField("g") else attribute.graphs)
        found.update(entry.value for tensor in tensors for entry in tensor.external_data if entry.key == "location")
    return found


def plan_key(digest: str, config: dict[str, str], handles) -> str:
    parts = {
        "format": FORMAT, "model": digest, "config": sorted(config.items()),
        "providers": [[handle.name, handle.source, _provider_version(handle), package_fingerprint(
            type(handle.provider).__module__)] for handle in handles],
        "runtime": package_fingerprint(__name__), "host": _host(),
        "environment": sorted((k, os.environ[k]) for k in os.environ  # (only the kept variables' values decoded)
                              if k.startswith("ONNX_RUNTIME_") and k not in _UNKEYED_VARIABLES),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


# Variables that change no plan: the cache's own, and when compiled loops load (steady-state benchmarks set it).
_UNKEYED_VARIABLES = frozenset({ENV_ENABLE, ENV_DIR, ENV_LIMIT, "ONNX_RUNTIME_COMPILE_IN_BACKGROUND"})


def _provider_version(handle) -> str:
    from .discovery import registry

    entry = registry().find(handle.name)
    return entry.version if entry is not None else ""


@functools.cache
def _host() -> str:
    return "|".join((platform.machine(), sys.version, np.__version__, onnx.__version__,
                     hashlib.sha256(cpu_flags_line().encode()).hexdigest()))


@functools.cache
def package_fingerprint(module_name: str) -> str:
    """Size and modification time of every Python module of ``module_name``'s top-level package: an edited
    install (or an editable one under development) never reads plans its old code wrote. A package that a
    wheel installed (beside its .dist-info) is keyed by the distribution's RECORD instead, which holds the
    SHA-256 of every file it installed and which each install, upgrade or reinstall rewrites: one read instead of
    a stat per module (~1.5 ms of a new process's creation). A module this process has imported already counts
    with the size and time its import read (package_finder.LOADED_STATS): the code it runs, and no second stat."""
    module = sys.modules.get(module_name.split(".")[0])
    folder = os.path.dirname(getattr(module, "__file__", None) or "")
    if not folder:
        return module_name
    record = installed_record(folder)
    if record is not None:
        return record
    rows, pending, skip, loaded = [], [folder], len(folder) + 1, LOADED_STATS
    while pending:  # a flat loop over scandir: os.walk's generator and path joins cost about what the stats do
        with os.scandir(pending.pop()) as listing:
            for entry in listing:
                if entry.name.endswith(".py"):
                    known = loaded.get(entry.path)  # (a module imported already was stat-ed by its import)
                    if known is None:
                        stat = entry.stat()
                        known = (stat.st_size, stat.st_mtime_ns)
                    rows.append(f"{entry.path[skip:]}\0{known[0]}\0{known[1]}")
                elif entry.name != "__pycache__" and entry.is_dir():
                    pending.append(entry.path)
    return hashlib.sha256("\n".join([folder, *sorted(rows)]).encode()).hexdigest()


def installed_record(folder: str) -> str | None:
    """A fingerprint of the RECORD of the distribution whose wheel installed the package ``folder`` (a
    ``<name>-<version>.dist-info`` beside it, named after the package, whose RECORD lists the package's
    ``__init__.py``), or None: an editable install or a source tree (their RECORD, if any, lists no module of
    the folder), where every module is stat'ed instead."""
    parent, package = os.path.split(folder)
    try:
        with os.scandir(parent) as listing:
            found = [entry.path for entry in listing if entry.name.endswith(".dist-info")
                     and entry.name.split("-", 1)[0].lower() == package.lower()]
    except OSError:
        return None
    for info in found:
        record = os.path.join(info, "RECORD")
        try:
            with open(record, "rb") as handle:
                data = handle.read()
            stat = os.stat(record)
        except OSError:
            continue
        if data.startswith(f"{package}/__init__.py,".encode()) or f"\n{package}/__init__.py,".encode() in data:
            return hashlib.sha256(b"\0".join([folder.encode(), record.encode(), data, str(stat.st_size).encode(),
                                                str(stat.st_mtime_ns).encode()])).hexdigest()
    return None


def signature_part(dims: tuple) -> str:
    """The part name of the specialization to ``dims`` (per input, per axis: an int or a symbol's 1-tuple)."""
    return "sig-" + hashlib.sha256(repr(dims).encode()).hexdigest()[:24]


# -- graphs in and out ----------------------------------------------------------------------------------------
def encode_graph(model, graph, weights: dict[str, np.ndarray], max_bytes: int) -> tuple[bytes, list[str]] | None:
    """``graph`` (of ``model``) as ModelProto bytes without the initializers that are still the arrays of
    ``weights`` (returned by name, to be taken from the model when read); None when the arrays the passes made
    (folded or fused weights) take more than ``max_bytes``: reading them back would cost about what making
    them does, and one such plan would push the others out of the folder; None too for text ONNX cannot hold."""
    from .ir import Graph
    from .serialize import model_to_proto

    references = [name for name, value in graph.initializers.items() if weights.get(name) is value]
    kept = {name: value for name, value in graph.initializers.items() if weights.get(name) is not value}
    if sum(getattr(value, "nbytes", 0) for value in kept.values()) > max_bytes:
        return None
    light = Graph(graph.name, graph.nodes, graph.inputs, graph.outputs, kept, graph.value_info, graph.opsets,
                  graph.outer_names, graph.doc)
    try:
        return model_to_proto(model, light).SerializeToString(), references
    except ValueError:  # text protobuf cannot hold (a name or string attribute that is not UTF-8): not cached
        return None


def decode_graph(data: bytes, references: list[str], weights: dict[str, np.ndarray], lazy: bool = False):
    """The graph ``encode_graph`` wrote, its references taken from ``weights``; ``lazy``: its nodes converted at
    their first use (loader.PlanGraph)."""
    from .loader import graph_from_plan

    missing = [name for name in references if name not in weights]
    if missing:
        raise ValueError(f"the plan names weights the model does not hold: {missing[:3]}")
    proto = onnx.ModelProto()
    proto.ParseFromString(data)
    return graph_from_plan(proto, {name: weights[name] for name in references}, lazy)


def encode_arrays(arrays: dict[str, np.ndarray]) -> bytes:
    from onnx import numpy_helper

    carrier = onnx.GraphProto()
    carrier.initializer.extend(numpy_helper.from_array(np.asarray(value), name) for name, value in arrays.items())
    return carrier.SerializeToString()


def decode_arrays(data: bytes) -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    carrier = onnx.GraphProto()
    carrier.ParseFromString(data)
    return {tensor.name: numpy_helper.to_array(tensor) for tensor in carrier.initializer}
