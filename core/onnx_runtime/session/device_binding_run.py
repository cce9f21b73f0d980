"""A run whose inputs and outputs are :class:`DeviceIoBinding` buffers (``run_with_device_bindings``).

Each input binding is fed as a tensor over its buffer, in place (the shape kernels see is
``kernel_input_shape``; a window at fixed physical strides that is not one contiguous run is gathered
into a temporary first). The run keeps the bound outputs where they are produced; each is then written
into its binding (device to device, stream-ordered, after the kernels that read the inputs) and the
binding's logical shape becomes the output's. Host-only sessions run through the session's
shape-specialized executor, with numpy views of the buffers as feeds.

While the run executes, a plugin on each device provider's handle (pluggy, as the device-graph runner
does it; registered once, acting only for the bound run in progress on the calling thread) makes every
output binding a recipient of the run's validation submission and, when no output goes to the host,
leaves the flags for the bindings to consume at their next host-visible read. It also notes the device
graph a replay or capture used, so a released binding resets the graph that recorded its address.
"""

from __future__ import annotations

import math
import operator
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .. import budget, kv_append, run_scope
from ..contract.buffers import DeviceBuffer
from ..contract.markers import hookimpl
from ..dtypes import DataType
from ..errors import InvalidArgumentError
from ..provider_handle import ProviderHandle
from ..tensor import Tensor
from . import device_step
from .device_io_binding import RELEASES, DeviceIoBinding, device_copy, strided_runs
from .executor import graph_slot_of


class SessionSide(NamedTuple):
    """What a bound run needs of its session (handed over by ``InferenceSession.run_with_device_bindings`` at
    every run: a tuple, made in a fraction of a frozen dataclass's time)."""

    handles: tuple[ProviderHandle, ...]
    output_names: tuple[str, ...]
    checked_input: Callable[[str, Any], Any]  # a host feed, checked against the model
    check_output_name: Callable[[str], Any]
    check_bound: Callable[..., None]  # a bound tensor's type and shape against the model's
    check_missing: Callable[[dict], None]
    executor_for: Callable[[dict], Any]  # the host executor for these feeds (shape-specialized)
    executor: Any  # the session's executor (device sessions)
    profile: Any
    # (a prepared host run's: the executor for its inputs' shapes in the model's input order, and what takes
    # shapes listed in a run's input order to that order, or None; unset: executor_for takes the feeds)
    executor_for_signature: Callable[[tuple], Any] | None = None
    signature_order: Callable[[tuple[str, ...]], Callable | None] | None = None


@dataclass(eq=False)
class _Run:
    """One bound run on one device provider, as the provider's hooks see it."""

    bindings: list[DeviceIoBinding]
    recipients: list[DeviceIoBinding]  # the output bindings
    defer: bool  # no output goes to the host: leave the flags to the bindings
    executor: Any = None  # the session's executor: names the nodes a binding's validation error suspects
    submission: Any = None


_ACTIVE = threading.local()  # .runs: id(handle) -> the _Run in progress on this thread
_REGISTER = threading.Lock()
_PLUGIN = "device-binding-runs"


class _RunHooks:
    """Plugin on a device provider's handle, registered at its first bound run: it acts only while a bound run
    is in progress on the calling thread (see the module docstring), so other threads' runs pass through."""

    def __init__(self, handle: ProviderHandle):
        self.handle = handle

    def _run(self) -> _Run | None:
        runs = getattr(_ACTIVE, "runs", None)
        return runs.get(id(self.handle)) if runs else None

    @hookimpl(wrapper=True)
    def begin_device_validation(self, registration):
        token = yield
        run = self._run()
        if run is not None and run.submission is None:  # the top-level submission; subgraphs nest inside it
            run.submission = token
            nodes = run.executor.validation_suspects(self.handle) if run.executor is not None else ()
            for binding in run.recipients:
                binding.set_device_validation(self.handle.hook.add_device_validation_recipient(
                    submission=token, recipient=binding.validation_registration), nodes)
        return token

    @hookimpl(tryfirst=True)
    def consume_device_validation_error(self, registration, token):
        run = self._run()
        if run is not None and run.defer and token == run.submission:
            return 0  # not read now: the output bindings consume it at their next host-visible read
        return None

    def _graph(self, token) -> None:
        run = self._run()
        for binding in run.bindings if run is not None else ():
            binding.set_device_graph_token(token)

    @hookimpl(wrapper=True)
    def begin_owned_device_graph_capture(self):
        token = yield
        self._graph(token)
        return token

    @hookimpl(wrapper=True)
    def replay_owned_device_graph(self, token):
        result = yield
        self._graph(token)
        return result


def _hooks_on(handle: ProviderHandle) -> None:
    with _REGISTER:
        if handle.pm.get_plugin(_PLUGIN) is None:
            handle.pm.register(_RunHooks(handle), name=_PLUGIN)


def run_with_device_bindings(session: SessionSide, bindings, input_feed: dict | None,
                             output_names, single_token_step: bool, run_options=None,
                             epilogue: device_step.StepEpilogue | None = None) -> list:
    """See :meth:`InferenceSession.run_with_device_bindings`."""
    bindings = tuple(bindings)
    layout = _layout(session, bindings, output_names)
    if layout.host and not input_feed:
        results = _run_on_host(session, layout, bindings, single_token_step)
        if epilogue is not None:
            epilogue.launch()
        return results
    feeds = {}
    for name, value in (input_feed or {}).items():
        if name in layout.input_names:
            raise InvalidArgumentError(f"input {name!r} is both fed and bound to a device binding; pass it once")
        feeds[name] = session.checked_input(name, value)
    temporaries: list[Tensor] = []
    try:
        for name, index, proof in layout.inputs:
            binding = bindings[index]
            value = _input_value(binding, single_token_step, temporaries)
            shape = tuple(value.shape)
            if not proof.admits(shape):  # the binding's dtype was checked against the model when it was made
                session.check_bound(name, value if isinstance(value, Tensor) else _Shaped(binding.dtype, shape),
                                    output=False)
                proof.learn(shape)
            feeds[name] = value
        if input_feed or not layout.complete:
            session.check_missing(feeds)
            layout.complete = not input_feed
        tail = _tail(layout, bindings, epilogue) if epilogue is not None else None
        values = _execute(session, bindings, feeds, layout.names, not layout.host_names, run_options,
                          layout.delivered, tail, epilogue)
    finally:
        for tensor in temporaries:
            tensor.close()
    count = len(layout.host_names)
    _finish(layout, bindings, values[count:], tail, epilogue)
    return [_host(value) for value in values[:count]]


class PreparedRun:
    """A :func:`prepared_host_run` inside its session's per-run scopes (the value budget, the providers' run
    scopes): a call enters them for one run; ``held()`` enters them once for a loop of runs (a generation's steps)
    and yields the run without them. ``closed``: whether the session was closed (checked at every run)."""

    __slots__ = ("_run", "_closed", "_limit", "_scopes")

    def __init__(self, run: Callable[[bool], list], closed: Callable[[], bool], limit, scopes):
        self._run, self._closed, self._limit, self._scopes = run, closed, limit, scopes

    def __call__(self, single_token_step: bool = False) -> list:
        self._check()
        token = budget.enter(self._limit, None)
        scopes = run_scope.enter(self._scopes)
        try:
            return self._run(single_token_step)
        finally:
            run_scope.leave(scopes)
            budget.leave(token)

    @contextmanager
    def held(self) -> Iterator[Callable[[bool], list]]:
        """The scopes entered once around the block (what runs between its steps, a caller's callback, sees them
        too: a run of another session inside enters its own over them)."""
        self._check()
        token = budget.enter(self._limit, None)
        scopes = run_scope.enter(self._scopes)
        try:
            yield self._held_run
        finally:
            run_scope.leave(scopes)
            budget.leave(token)

    def _held_run(self, single_token_step: bool = False) -> list:
        self._check()  # (a step's caller may close the session between steps)
        return self._run(single_token_step)

    def _check(self) -> None:
        if self._closed():
            raise InvalidArgumentError("this session was closed; create a new InferenceSession")


def prepared_host_run(session: SessionSide, bindings, output_names) -> Callable[[bool], list] | None:
    """:func:`run_with_device_bindings` for a loop that binds the same host buffers at every call (a decode loop's):
    the bindings are laid out and checked once, here; the callable takes ``single_token_step`` and runs as that
    function does, without the per-call layout lookup. None unless every binding is in host memory and every
    provider is a host one (the caller then runs each step through :func:`run_with_device_bindings`)."""
    bindings = tuple(bindings)
    layout = _layout(session, bindings, output_names)
    if not layout.host:
        return None
    order = None if session.signature_order is None else \
        session.signature_order(tuple(name for name, *_ in layout.shown))
    # (the feeds' shapes, as _host_feeds has them, name the executor: not read from the feeds again)
    feed = None if order is None else _feed_by_signature(session, order)
    releases, seen = RELEASES, [RELEASES[0]]

    def run(single_token_step: bool = False) -> list:
        # (the layout was made for these very bindings, which this closure keeps alive: only a release can undo it;
        # the bindings are looked at only after some binding anywhere was released)
        if releases[0] != seen[0]:
            now = releases[0]  # (read before the look: a release during it is looked at next run)
            if any([binding.closed for binding in bindings]):
                raise InvalidArgumentError("a device binding of this prepared run was released; prepare the run again")
            seen[0] = now
        return _run_on_host(session, layout, bindings, single_token_step, feed)

    return run


def _feed_by_signature(session: SessionSide, order: Callable) -> Callable[[_Layout, tuple, bool], tuple]:
    """_run_on_host's ``feed`` for a prepared run whose inputs are the model's: the executor from the shapes
    _host_feeds met, put in the model's input order by ``order``."""
    executor_for_signature = session.executor_for_signature
    assert executor_for_signature is not None
    # The shapes fed -> (the feeds, their executor), each found once by _host_feeds (which checks a new shape) and
    # the specializer: a decode loop feeds one set per length, again in every later generation on these bindings,
    # and the views of a set are the same (the buffers never move).
    known: dict[tuple, tuple] = {}

    def feed(layout: _Layout, bindings: tuple, single_token_step: bool) -> tuple:
        shapes = tuple([bindings[index].logical_shape if logical else bindings[index].physical_shape
                        for index, logical in (layout.fed_step if single_token_step else layout.fed_first)])
        found = known.get(shapes)
        if found is None:
            feeds, listed = _host_feeds(session, layout, bindings, single_token_step, [])
            found = (feeds, executor_for_signature(order(listed)))
            if len(known) >= _Layout.LIMIT:
                known.clear()
            known[shapes] = found
        return found

    return feed


def _finish(layout: _Layout, bindings: tuple, values, tail: device_step.CapturedTail | None,
            epilogue: device_step.StepEpilogue | None) -> None:
    """The bound outputs written and the epilogue launched, unless the replayed graph did both."""
    if tail is not None and tail.captured:
        for (_name, index, _proven, _dtype), value in zip(layout.outputs, values):
            bindings[index].set_logical_shape(tuple(value.shape))
        return
    _write_outputs(layout, bindings, values)
    if epilogue is not None:
        epilogue.launch()


def _write_outputs(layout: _Layout, bindings: tuple, values) -> None:
    produced = list(zip(layout.outputs, values))
    for (name, index, proven, _dtype), value in produced:  # every shape checked before any binding is written
        _check_output(bindings[index], name, value, proven)
    for (_name, index, _proven, _dtype), value in produced:
        _deliver(bindings[index], value)


def _tail(layout: _Layout, bindings: tuple, epilogue: device_step.StepEpilogue) -> device_step.CapturedTail:
    """The run's output writes and ``epilogue``, for the device-graph runner to capture (device_step.py): the
    values it gets are those of the names the run asked for, the host outputs first."""
    count = len(layout.host_names)

    def run(values: list) -> None:
        _write_outputs(layout, bindings, values[count:])
        epilogue.launch()

    targets = tuple((bindings[index].buffer.ptr, bindings[index].physical_shape)
                    for _name, index, _proven, _dtype in layout.outputs)
    return device_step.CapturedTail(run, (targets, epilogue.key))


def _run_on_host(session: SessionSide, layout: _Layout, bindings: tuple, single_token_step: bool,
                 feed: Callable[[_Layout, tuple, bool], tuple] | None = None) -> list:
    """The bound run of a host session on host bindings: what :func:`run_with_device_bindings` does, in the few
    steps that case takes (a decode step's kernels on small weights take tens of microseconds, so what surrounds
    them shows): each input a view of its buffer (a window of it at fixed physical strides), the executor's run,
    each output copied in. A KV cache at fixed strides (an input aliased by its output) is appended in place by
    the Concat that makes its output (kv_append.py), which the copy then skips. ``feed``: a prepared run's
    (feeds, their executor), else the feeds and executor_for's."""
    if feed is None:
        feeds, executor = _host_feeds(session, layout, bindings, single_token_step), None
    else:
        feeds, executor = feed(layout, bindings, single_token_step)
    windows = layout.windows
    for window in windows:
        window.fed = feeds[window.output_input]
        window.result = None
    if not layout.complete:
        session.check_missing(feeds)
        layout.complete = True
    saved = kv_append.enter(layout.keyed) if windows else None
    try:
        if executor is None:
            executor = session.executor_for(feeds)
        values = executor.run(feeds, layout.names, session.profile)
    finally:
        if windows:
            kv_append.leave(saved)
    count = len(layout.host_names)
    if not (layout.every_appended and _adopted(layout, bindings, values[count:])):
        _host_outputs(layout, bindings, values[count:])
    return values[:count]


def _host_feeds(session: SessionSide, layout: _Layout, bindings: tuple, single_token_step: bool,
                shapes: list | None = None):
    """Each bound input as a view of its buffer: the same view as the last run's where the shape is the same.
    With ``shapes`` (a list), also their shapes in ``layout.shown``'s order, appended there: (feeds, shapes)."""
    feeds = {}
    shown = shapes.append if shapes is not None else None
    physical = layout.physical
    for name, index, proof, exposed, frozen in layout.shown:
        binding = bindings[index]
        # (kernel_input_shape, its flags read once per layout: a decode step feeds seven bindings)
        shape = binding.logical_shape if exposed and not (single_token_step and frozen) else binding.physical_shape
        if shown is not None:
            shown(shape)
        last_shape, last_view = proof.last
        if shape == last_shape:  # fed as the last run fed it: the same view
            feeds[name] = last_view
            continue
        views = proof.views
        view = views.get(shape)
        if view is None:  # a shape not fed before (a view of it passed the check: the buffer never moves)
            if not proof.admits(shape):  # the binding's dtype was checked against the model when it was made
                session.check_bound(name, _Shaped(binding.dtype, shape), output=False)
                proof.learn(shape)
            whole = physical.get(index)
            if whole is None:
                view = binding.host_array()[: math.prod(shape)].reshape(shape)
            else:
                view = whole[tuple(map(slice, shape))]
            if len(views) >= _Layout.LIMIT:
                views.clear()
            views[shape] = view
        feeds[name] = view
        proof.last = (shape, view)
    return feeds if shapes is None else (feeds, shapes)


def _host_outputs(layout: _Layout, bindings: tuple, values: list) -> None:
    """Each output (``values``, in ``layout.outputs``' order) copied into its binding, its shape adopted. A cache
    window appended in place (kv_append) is the binding's own buffer within its capacity by construction: it needs
    no copy and no check, only its shape adopted and kept as the next run's view of that input."""
    outputs, appended = layout.outputs, layout.appended
    plain = True
    for (name, index, proven, dtype), window, value in zip(outputs, appended, values):
        if window is not None and value is window.result:
            continue
        binding = bindings[index]
        physical_shape = binding.physical_shape
        if type(value) is not np.ndarray or value.dtype != dtype or value.ndim != len(physical_shape) \
                or not all(map(operator.le, value.shape, physical_shape)):
            _check_output(binding, name, value, proven)  # raises what is wrong, if anything is
            plain = False
    if not plain:  # (every shape was checked above, before any binding is written)
        for (_name, index, _proven, _dtype), value in zip(outputs, values):
            _deliver(bindings[index], value)
        return
    physical, aliased = layout.physical, layout.aliased
    for (_name, index, _proven, _dtype), window, value in zip(outputs, appended, values):
        binding = bindings[index]
        shape = value.shape
        if window is not None and value is window.result:
            view = value
            binding.set_appended_shape(shape)
        else:
            whole = physical.get(index)
            if whole is None:
                view = binding.host_array()[: value.size].reshape(shape)
            else:
                view = whole[tuple(map(slice, shape))]
            view[...] = value  # numpy copes with an aliased output
            binding.set_logical_shape(shape)
        alias = aliased.get(index)
        if alias is not None and alias.admits(shape):  # the next run feeds this view (a KV cache's next step)
            alias.last = (shape, view)


def _adopted(layout: _Layout, bindings: tuple, values: list) -> bool:
    """Where every output is its window's result (a host decode step's presents): their shapes adopted, each kept
    as the next run's view of its input; False, with nothing done, where one is not (_host_outputs' general way)."""
    appending = layout.appending
    for (_index, window, _alias), value in zip(appending, values):
        if value is not window.result:
            return False
    for (index, window, alias), value in zip(appending, values):
        shape = value.shape
        bindings[index].set_appended_shape(shape)
        if alias is not None:
            # The window's other axes are its past's, which this input was fed at: once its length was seen to
            # vary, the longer window passes the check too (admits, without its call).
            free, axis = alias.free, window.axis
            if (axis < len(free) and free[axis]) or alias.admits(shape):
                alias.last = (shape, value)
    return True


class _Window(kv_append.Window):
    """A cache's window (kv_append.Window) with the input name it is fed as."""

    __slots__ = ("output_input",)

    def __init__(self, input_name: str, physical: np.ndarray, axis: int, output: str):
        super().__init__(physical[:0], physical, axis, output)
        self.output_input = input_name


def _growing_axis(binding: DeviceIoBinding) -> int | None:
    """The one axis a cache's window may be shorter than its capacity on (a KV cache's sequence axis); None
    where the binding's own spec does not say which (its logical shape short on none, or several, axes)."""
    short = [axis for axis, (n, capacity) in enumerate(zip(binding.logical_shape, binding.physical_shape))
             if n < capacity]
    return short[0] if len(short) == 1 else None


class _Layout:
    """One set of bindings sorted into the inputs and outputs they bind, with the checks that passed, for
    every later run with the same bindings (a decode loop binds the same buffers each step): the bindings'
    own checks run once, the shapes each input is fed at and each output is delivered at are checked once
    per shape, and the requested host outputs once. A released binding, or another set, is laid out anew
    (and raises what those checks raise)."""

    __slots__ = ("bindings", "input_names", "inputs", "outputs", "host_names", "names", "delivered", "complete",
                 "host", "aliased", "physical", "windows", "window_at", "appended", "keyed", "shown", "every_appended",
                 "appending", "fed_first", "fed_step")

    LIMIT = 256  # shapes remembered per binding (a window without bound: start over past it)

    def __init__(self, session: SessionSide, bindings: tuple, output_names):
        inputs, outputs = _sorted(session, list(bindings))
        self.bindings = tuple(weakref.ref(binding) for binding in bindings)
        self.input_names = frozenset(inputs)
        # (name, the binding's position among the run's bindings, the shapes it passed at): positions, not the
        # bindings, so a layout never keeps a binding alive (a dropped one is released when collected).
        position = {id(binding): index for index, binding in enumerate(bindings)}
        self.inputs = tuple((name, position[id(binding)], _InputProof()) for name, binding in inputs.items())
        self.outputs: tuple[tuple[str, int, set, np.dtype], ...] = tuple(
            (name, position[id(binding)], set(), binding.dtype.numpy) for name, binding in outputs.items())
        # Position of a binding that is both an input and an output -> its input's proof.
        self.aliased = {index: proof for _name, index, proof in self.inputs if bindings[index].output_name}
        # The inputs with what decides the shape kernels see (kernel_input_shape's flags: fixed per binding).
        self.shown = tuple((name, index, proof, bindings[index].exposes_logical_input_shape(),
                            bindings[index].mask_decode_freeze_safe()) for name, index, proof in self.inputs)
        # Per input in ``shown``'s order, its position and whether it is fed at its logical shape (else its physical
        # one), at a first step and at a single-token step: the shapes a prepared run reads before any view.
        self.fed_first = tuple((index, exposed) for _name, index, _proof, exposed, _frozen in self.shown)
        self.fed_step = tuple((index, exposed and not frozen) for _name, index, _proof, exposed, frozen in self.shown)
        self.host_names = _host_names(session, output_names, outputs)
        self.names = self.host_names + tuple(outputs)
        self.delivered = frozenset(outputs)
        self.complete = False  # whether the bound inputs alone were found to leave no input missing
        # Host providers only, every binding in host memory: inputs are views, outputs plain copies.
        self.host = all(handle.is_host_accessible for handle in session.handles) and all(
            binding.host_array() is not None for binding in bindings)
        # Position -> the whole buffer at its physical shape, for the bindings laid out at fixed strides (fed and
        # written as windows of it); the caches among them, appended in place (kv_append.py).
        self.physical: dict[int, np.ndarray] = {}
        self.windows: list[_Window] = []
        self.window_at: dict[int, _Window] = {}  # position of a cache's binding -> its window
        if self.host:
            for index, binding in enumerate(bindings):
                if binding.fixed_physical_strides():
                    whole = self.physical[index] = binding.host_array()[: math.prod(binding.physical_shape)] \
                        .reshape(binding.physical_shape)
                    axis = _growing_axis(binding)
                    if binding.output_name and index in self.aliased and axis is not None:
                        name = next(name for name, at, _proof in self.inputs if at == index)
                        self.windows.append(_Window(name, whole, axis, binding.output_name))
                        self.window_at[index] = self.windows[-1]
        # Per output (in ``outputs``' order): the window its binding is appended through in place, else None.
        self.appended = tuple(self.window_at.get(index) for _name, index, _proven, _dtype in self.outputs)
        # Whether every output is appended in place (a host decode state's presents), and per output its position,
        # window and aliased input's proof: a run whose outputs are all their windows' results only adopts shapes.
        self.appending = tuple((index, window, self.aliased.get(index)) for (_name, index, _proven, _dtype), window
                               in zip(self.outputs, self.appended) if window is not None)
        self.every_appended = bool(self.outputs) and len(self.appending) == len(self.outputs)
        self.keyed = kv_append.by_output(self.windows)  # as each run names them to its Concats

    def holds(self, bindings: tuple[DeviceIoBinding, ...]) -> bool:
        if len(bindings) != len(self.bindings):
            return False
        for ref, binding in zip(self.bindings, bindings):
            if ref() is not binding or binding.closed:
                return False
        return True


# A session's executor -> its layouts, by the bindings' identities and the requested host outputs.
_LAYOUTS: weakref.WeakKeyDictionary[Any, dict[tuple, _Layout]] = weakref.WeakKeyDictionary()
_LAYOUTS_PER_SESSION = 16


def _layout(session: SessionSide, bindings: tuple, output_names) -> _Layout:
    names = None if output_names is None else tuple(output_names)  # (read once: it may be an iterator)
    key = (tuple(map(id, bindings)), names)
    layouts = _LAYOUTS.get(session.executor)
    layout = layouts.get(key) if layouts is not None else None
    if layout is not None and layout.holds(bindings):
        return layout
    layout = _Layout(session, bindings, names)  # raises what is wrong with the bindings
    if layouts is None:
        layouts = _LAYOUTS.setdefault(session.executor, {})
    if len(layouts) >= _LAYOUTS_PER_SESSION:  # each generation binds new buffers: the old sets go
        layouts.clear()
    layouts[key] = layout
    return layout


class _InputProof:
    """The shapes a bound input passed the model's check at, as one shape and the axes seen to vary: two passing
    shapes that differ on an axis show the model leaves it free (a fixed dimension would have refused one), so a
    shape equal to the first on every other axis passes too. A decode loop's growing past and mask are then
    checked on their first two steps only. On the host path it also keeps the last view fed (``last``: shape and
    view): an input fed at the same shape again is the same view of the same buffer. Each is replaced as one
    tuple, so a run on another thread reads a consistent one."""

    __slots__ = ("reference", "free", "last", "views", "_test")

    def __init__(self):
        self.reference: tuple | None = None
        self.free: tuple[bool, ...] = ()
        self.last: tuple = (None, None)
        # Shape -> the view fed at it (host path): a decode loop's mask takes a new length every step, each length
        # again in every later generation on the same bindings.
        self.views: dict[tuple, Any] = {}
        # (rank, a getter of the axes not seen to vary, their values): read in one C call per test.
        self._test: tuple[int, Callable[[tuple], Any], tuple] = (-1, operator.itemgetter(slice(0, 0)), ())

    def admits(self, shape: tuple) -> bool:
        rank, fixed, values = self._test
        return len(shape) == rank and tuple(fixed(shape)) == values

    def learn(self, shape: tuple) -> None:
        """``shape`` passed the check."""
        reference = self.reference
        if reference is None or len(shape) != len(reference):
            reference, free = shape, (False,) * len(shape)
        else:
            free = tuple(was or got != first for got, first, was in zip(shape, reference, self.free))
        self.reference, self.free = reference, free
        axes = [axis for axis, varies in enumerate(free) if not varies]
        fixed = operator.itemgetter(*axes) if len(axes) > 1 else operator.itemgetter(
            slice(axes[0], axes[0] + 1) if axes else slice(0, 0))
        self._test = (len(shape), fixed, tuple(fixed(reference)))


def _remember(proven: set, key) -> None:
    if len(proven) >= _Layout.LIMIT:
        proven.clear()
    proven.add(key)


def _sorted(session: SessionSide, bindings: list) -> tuple[dict[str, DeviceIoBinding], dict[str, DeviceIoBinding]]:
    """The bindings by the input and the output they bind, each checked."""
    inputs: dict[str, DeviceIoBinding] = {}
    outputs: dict[str, DeviceIoBinding] = {}
    for binding in bindings:
        if not isinstance(binding, DeviceIoBinding):
            raise InvalidArgumentError(f"bindings must be DeviceIoBinding objects, got {type(binding).__name__}")
        if binding.closed:
            raise InvalidArgumentError(f"device binding {binding.label} was released; create a new one")
        if binding.allocator not in session.handles:
            raise InvalidArgumentError(
                f"device binding {binding.label} belongs to {binding.allocator!r}, not to a provider of this "
                f"session; create it with this session's device_io_binding"
            )
        if not binding.binds_input and not binding.output_name:
            raise InvalidArgumentError(f"device binding {binding.label} is bound to no input or output of the graph")
        if binding.binds_input:
            if binding.input_name in inputs:
                raise InvalidArgumentError(f"input {binding.input_name!r} is bound by two device bindings")
            inputs[binding.input_name] = binding
        if binding.output_name:
            if binding.output_name in outputs:
                raise InvalidArgumentError(f"output {binding.output_name!r} is bound by two device bindings")
            outputs[binding.output_name] = binding
    return inputs, outputs


def _host_names(session: SessionSide, output_names, outputs: dict[str, DeviceIoBinding]) -> tuple[str, ...]:
    if output_names is None:
        return tuple(n for n in session.output_names if n not in outputs)
    for name in output_names:
        session.check_output_name(name)
        if name in outputs:
            raise InvalidArgumentError(
                f"output {name!r} is bound to device binding {outputs[name].label}; read it from the binding"
            )
    return tuple(output_names)


def _execute(session: SessionSide, bindings: list[DeviceIoBinding], feeds: dict, names: tuple[str, ...],
             defer: bool, run_options, delivered: frozenset[str], tail: device_step.CapturedTail | None = None,
             epilogue: device_step.StepEpilogue | None = None) -> list:
    """The run's values of ``names``; ``delivered``: the outputs written into bindings right after it (a replay
    may hand them out as views of its graph's buffers, which only its next replay rewrites)."""
    if all(handle.is_host_accessible for handle in session.handles):
        for name, value in feeds.items():
            if isinstance(value, Tensor):
                feeds[name] = value.numpy()  # a view, no copy
        return session.executor_for(feeds).run(feeds, names, session.profile)
    slot = graph_slot_of(run_options)
    runs = getattr(_ACTIVE, "runs", None)
    if runs is None:
        runs = _ACTIVE.runs = {}
    saved = dict(runs)
    noted = (*bindings, *epilogue.bindings) if epilogue is not None else bindings  # graph tokens on release
    for handle in {id(b.allocator): b.allocator for b in bindings if not b.allocator.is_host_accessible}.values():
        _hooks_on(handle)
        mine = [b for b in noted if b.allocator is handle]
        runs[id(handle)] = _Run(mine, [b for b in bindings if b.allocator is handle and b.output_name], defer,
                                session.executor)
    device_step.hand_over(tail)
    try:
        # The deferral is the plugin's (recipient tokens), not the executor's: a recipient's read settles the
        # submission, which the executor must not then reuse.
        writes = tuple(b.buffer for b in bindings if b.output_name and not b.allocator.is_host_accessible)
        return session.executor.run_bound(feeds, names, True, session.profile, slot, copied=delivered, writes=writes)
    finally:
        device_step.hand_over(None)
        runs.clear()
        runs.update(saved)


def _input_value(binding: DeviceIoBinding, single_token_step: bool, temporaries: list[Tensor]):
    """The binding's buffer in the shape kernels see: an array view on host memory, else a tensor over it (a
    window at fixed strides that is not one run is gathered into a temporary; see the module docstring)."""
    shape = binding.kernel_input_shape(single_token_step)
    host = binding.host_array()
    if host is not None and not binding.fixed_physical_strides():  # the valid part, compact from the start
        return host[: math.prod(shape)].reshape(shape)
    itemsize = binding.dtype.numpy.itemsize
    nbytes = math.prod(shape) * itemsize
    runs = strided_runs(binding.physical_shape, shape, itemsize) if binding.fixed_physical_strides() else []
    handle, buffer = binding.allocator, binding.buffer
    if buffer.host is not None:
        if len(runs) <= 1:
            start = runs[0][0] if runs else 0
            return buffer.host[start: start + nbytes].view(binding.dtype.numpy).reshape(shape)
        gathered_bytes = np.empty(nbytes, np.uint8)
        for physical, compact, size in runs:
            gathered_bytes[compact: compact + size] = buffer.host[physical: physical + size]
        return gathered_bytes.view(binding.dtype.numpy).reshape(shape)
    if len(runs) <= 1:
        start = runs[0][0] if runs else 0
        return Tensor(binding.dtype, shape, buffer.alias(start, nbytes), handle)
    gathered = Tensor.empty(binding.dtype, shape, handle)
    temporaries.append(gathered)
    for physical, compact, size in runs:
        device_copy(handle, buffer, physical, gathered.buffer, compact, size)
    return gathered


class _Shaped:
    """A host view's element type and shape, as the session's bound-tensor check reads them."""

    __slots__ = ("dtype", "shape")

    def __init__(self, dtype: DataType, shape: tuple[int, ...]):
        self.dtype, self.shape = dtype, shape


def _check_output(binding: DeviceIoBinding, name: str, value, proven: set) -> None:
    """A run's output against the binding that receives it: its dtype, rank and capacity (once per shape)."""
    if isinstance(value, Tensor):
        dtype = value.dtype
    elif isinstance(value, np.ndarray) and value.dtype == binding.dtype.numpy:
        dtype = binding.dtype
    else:
        dtype = DataType.from_numpy(np.asarray(value).dtype)
    shape = tuple(value.shape)
    key = (dtype, shape, binding.physical_shape)
    if key in proven:
        return
    if dtype is not binding.dtype:
        raise InvalidArgumentError(
            f"output {name!r} is {dtype.name}, but device binding {binding.label} holds {binding.dtype.name}; "
            f"create the binding with dtype {dtype.name}"
        )
    physical = binding.physical_shape
    if len(shape) != len(physical):
        raise InvalidArgumentError(
            f"output {name!r} has shape {list(shape)}, of another rank than device binding {binding.label} "
            f"({list(physical)}); bind it with a physical shape of rank {len(shape)}"
        )
    if any(d > c for d, c in zip(shape, physical)):
        raise InvalidArgumentError(
            f"output {name!r} has shape {list(shape)}, beyond the capacity {list(physical)} of device binding "
            f"{binding.label}; allocate the binding with a larger physical shape"
        )
    _remember(proven, key)


def _deliver(binding: DeviceIoBinding, value) -> None:
    """Write a run's output into ``binding`` (compactly, or scattered at fixed strides) and adopt its shape."""
    shape = tuple(value.shape)
    host = binding.host_array()
    if host is not None and not binding.fixed_physical_strides() and not isinstance(value, Tensor):
        host[: math.prod(shape)].reshape(shape)[...] = value  # numpy copes with an output aliasing the buffer
        binding.set_logical_shape(shape)
        return
    handle, target = binding.allocator, binding.buffer
    itemsize = binding.dtype.numpy.itemsize
    runs = strided_runs(binding.physical_shape, shape, itemsize) if binding.fixed_physical_strides() else \
        [(0, 0, math.prod(shape) * itemsize)]
    device_value = isinstance(value, Tensor) and value.device == target.device and not handle.is_host_accessible
    if device_value:
        source = value.buffer
        if len(runs) == 1 and source.ptr == target.ptr + runs[0][0]:
            pass  # the kernel wrote it in place
        elif _overlaps(source, target):  # an output aliasing this buffer elsewhere: stage it first
            with value.try_clone() as staged:
                _scatter(value.provider, staged.buffer, target, runs)
        else:  # on the producer's stream, so a captured step records it (another session's binding too)
            _scatter(value.provider, source, target, runs)
    elif handle.is_host_accessible:
        raw = np.ascontiguousarray(value.numpy() if isinstance(value, Tensor) else value).reshape(-1).view(np.uint8)
        view = target.host_view()
        for physical, compact, size in runs:
            view[physical: physical + size] = raw[compact: compact + size]  # numpy copes with overlap
    else:  # produced on the host (or another device) for a device binding: an upload, counted
        raw = np.ascontiguousarray(value.numpy() if isinstance(value, Tensor) else value).reshape(-1).view(np.uint8)
        for physical, compact, size in runs:
            binding.write_bytes(physical, raw[compact: compact + size])
    binding.set_logical_shape(shape)


def _scatter(handle: ProviderHandle, source: DeviceBuffer, target: DeviceBuffer, runs) -> None:
    for physical, compact, size in runs:
        device_copy(handle, source, compact, target, physical, size)


def _overlaps(a: DeviceBuffer, b: DeviceBuffer) -> bool:
    return a.ptr < b.ptr + b.size and b.ptr < a.ptr + a.size


def _host(value):
    if isinstance(value, Tensor):
        return value.numpy() if not value.provider.is_host_accessible else value.numpy().copy()
    return value
