"""Device graphs: stream capture on the instance's compute stream, per (owner, slot) lifecycles with generations.

A capture records everything enqueued on the device's compute stream between ``begin`` and ``end``
(cuStreamBeginCapture in thread-local mode, cuStreamEndCapture, cuGraphInstantiate); a replay
launches the executable graphs (cuGraphLaunch) on the same stream, so a replay is ordered after the
uploads before it and before the downloads after it.

Namespaces. Every graph lives in an owner's namespace (a :class:`DeviceGraphOwner`, one per executor)
and one of its slots (PRIMARY, the decode step; VERIFY, the speculative verify step), so the two
slots, and the graphs of different sessions, never replace each other. A lifecycle holds at most one
installed *generation*; a fresh capture mints a new, never reused generation (from one counter per
provider instance) and destroys the previous one, so a token of the old generation can no longer
replay, reset or test anything, and cannot reach another owner's graphs either.

Segments. A generation is a list of segments in capture order: ``begin`` with ``continuation`` set
to the generation's token records the next segment (the executor runs the non-capturable seams
eagerly in between). ``replay`` launches every segment, ``replay_segment`` one of them.

Threads. A capture records the instance's compute stream (its lane, lanes.py) whoever enqueues on it, so
``begin`` takes the lane's gate (``CudaDevice.begin_capture``) and ``end``/``abort`` give it back: another
thread's call on that lane waits for the capture to end rather than landing in the graph or invalidating it.
Other instances' lanes are not held: two sessions capture at once.

Exactly once. Each segment's CUgraphExec and CUgraph are destroyed once: when a fresh capture replaces
the generation, on ``reset``, ``retire`` or ``close``. ``abort`` always ends the stream's capture
(even an invalidated one) and discards the partial graph, so the stream is idle and a later
``reset`` succeeds.
"""

from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field

from onnx_runtime.contract.graphs import DeviceGraphOwner, DeviceGraphSlot, DeviceGraphToken
from onnx_runtime.errors import InvalidArgumentError, ProviderError

NAME = "CUDAExecutionProvider"


@dataclass(eq=False)
class _Segment:
    graph: object  # CUgraph
    executable: object  # CUgraphExec
    prologues: tuple = ()  # validation owners whose generation prologue the segment recorded (validation.py)
    reads: tuple = ()  # memory keys the segment reads and writes (access.py), ordered again before each launch
    writes: tuple = ()


@dataclass(eq=False)
class _Lifecycle:
    owner: DeviceGraphOwner
    slot: DeviceGraphSlot
    generation: int = 0  # the installed (or being captured) generation; 0 before the first capture
    segments: list[_Segment] = field(default_factory=list)
    capturing: bool = False
    reads: tuple = ()  # the union of the segments' keys, for a replay of them all
    writes: tuple = ()

    def token(self) -> DeviceGraphToken:
        return DeviceGraphToken(self.owner, self.slot, self.generation)

    def names(self, token: DeviceGraphToken) -> bool:
        return token.owner == self.owner and token.slot == self.slot and token.generation == self.generation


class DeviceGraphs:
    """The device graphs of one provider instance on one :class:`CudaDevice` (see the module docstring)."""

    def __init__(self, device, validation=None):
        self.device = device
        self.validation = validation  # the provider's DeviceValidation: prologues recorded in, claimed by launches
        self._lock = threading.RLock()
        self._lifecycles: dict[tuple[DeviceGraphOwner, DeviceGraphSlot], _Lifecycle] = {}
        self._generations = itertools.count(1)
        self._active: _Lifecycle | None = None  # the lifecycle whose capture the compute stream is recording
        self.instantiated = 0  # executable graphs made; every one is destroyed exactly once
        self.destroyed = 0

    # -- plumbing -----------------------------------------------------------------------------------
    def _check(self, result, call: str):
        return self.device._check(result, call)  # the device turns a fault into CudaDeviceFaultError

    def _capture_failure(self, error: ProviderError) -> ProviderError:
        detail = ""
        last_error = getattr(self.device.driver, "last_error_message", None)  # the simulator says why
        if callable(last_error) and last_error():
            detail = f" ({last_error()})"
        return ProviderError(
            f"{error}{detail}; the capture was discarded. Work recorded into a device graph must stay on the "
            f"compute stream and must not synchronize with the host (a kernel that reads device data on the "
            f"host cannot be captured)"
        )

    @staticmethod
    def _slot(slot) -> DeviceGraphSlot:
        try:
            return DeviceGraphSlot(slot)
        except ValueError:
            raise InvalidArgumentError(
                f"{NAME}: {slot!r} is not a device graph slot; use PRIMARY or VERIFY") from None

    @staticmethod
    def _token(token) -> DeviceGraphToken:
        if not isinstance(token, DeviceGraphToken):
            raise InvalidArgumentError(
                f"{NAME}: expected the DeviceGraphToken a capture returned, got {type(token).__name__}"
            )
        return token

    def _lookup(self, token) -> _Lifecycle | None:
        token = self._token(token)
        return self._lifecycles.get((token.owner, token.slot))

    def _installed(self, token) -> _Lifecycle:
        """The lifecycle whose installed generation ``token`` names exactly; refuses anything else."""
        lifecycle = self._lookup(token)
        if lifecycle is None or not lifecycle.names(token) or not lifecycle.segments or lifecycle.capturing:
            raise InvalidArgumentError(
                f"{NAME}: device graph token (owner {token.owner.id}, slot {token.slot.name}, generation "
                f"{token.generation}) does not name an installed graph: it is stale (re-captured or reset), "
                f"foreign, or its capture has not ended; capture again and use the token it returns"
            )
        return lifecycle

    def _destroy(self, lifecycle: _Lifecycle) -> bool:
        segments, lifecycle.segments = lifecycle.segments, []
        lifecycle.reads = lifecycle.writes = ()
        d = self.device.driver
        for segment in segments:
            self.device.forget_graph(segment, (*segment.reads, *segment.writes))
            if not self.device.closed:  # a released context took its graphs with it
                self._check(d.cuGraphExecDestroy(segment.executable), "cuGraphExecDestroy")
                self._check(d.cuGraphDestroy(segment.graph), "cuGraphDestroy")
            self.destroyed += 1
        return bool(segments)

    def _end_stream_capture(self):
        """End the compute stream's capture and give the device's gate back; the CUgraph, or raise (the stream
        is idle either way)."""
        try:
            self.device._bind()
            return self._check(self.device.driver.cuStreamEndCapture(self.device.compute), "cuStreamEndCapture")
        finally:
            self.device.end_capture()

    # -- capture ------------------------------------------------------------------------------------
    def begin(self, owner, slot, continuation=None) -> DeviceGraphToken:
        """Start recording the compute stream into ``owner``'s ``slot``; return the generation's token."""
        if not isinstance(owner, DeviceGraphOwner):
            raise InvalidArgumentError(f"{NAME}: expected a DeviceGraphOwner, got {type(owner).__name__}")
        slot = self._slot(slot)
        with self._lock:
            if self._active is not None:
                active = self._active
                raise ProviderError(
                    f"{NAME}: a device graph capture is already in progress (owner {active.owner.id}, slot "
                    f"{active.slot.name}); end or abort it before beginning another"
                )
            lifecycle = self._lifecycles.setdefault((owner, slot), _Lifecycle(owner, slot))
            if continuation is None:
                self._destroy(lifecycle)  # the new generation replaces the installed one
                lifecycle.generation = next(self._generations)
            elif not (isinstance(continuation, DeviceGraphToken) and lifecycle.names(continuation)
                      and lifecycle.segments):
                raise InvalidArgumentError(
                    f"{NAME}: continuation {continuation!r} does not name the installed generation of owner "
                    f"{owner.id} slot {slot.name}; a later segment extends the generation its first segment "
                    f"installed (pass None to capture a new generation)"
                )
            d = self.device.driver
            lane = self.device
            self.device._bind()
            self.device.begin_capture()
            # The run's feeds and bound outputs (its order_device_access call) belong to its first segment.
            run_reads, run_writes = lane.run_access if continuation is None else ((), ())
            lane.run_access = ((), ())
            lane.captured_reads = set(lane.resolve_keys(run_reads))
            lane.captured_writes = set(lane.resolve_keys(run_writes))
            try:
                self._check(d.cuStreamBeginCapture(self.device.compute,
                                                   d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL),
                            "cuStreamBeginCapture(compute stream)")
            except BaseException:
                self.device.end_capture()
                self.device.settle_capture()
                raise
            lifecycle.capturing = True
            self._active = lifecycle
            return lifecycle.token()

    def _capturing(self, token) -> _Lifecycle:
        lifecycle = self._lookup(token)
        if lifecycle is None or not lifecycle.capturing or lifecycle is not self._active:
            raise InvalidArgumentError(f"{NAME}: no device graph capture is in progress for {token!r}")
        if not lifecycle.names(token):
            raise InvalidArgumentError(
                f"{NAME}: {token!r} is stale: the capture in progress is generation {lifecycle.generation}"
            )
        return lifecycle

    def end(self, token) -> None:
        """End the capture ``token`` names and install it as the generation's next segment; then free what was freed
        during the capture (``CudaDevice.settle_capture``: a graph that recorded it is reset)."""
        try:
            self._end(token)
        finally:
            self.device.settle_capture()  # outside the lock: a free may reset other instances' graphs

    def _end(self, token) -> None:
        with self._lock:
            lifecycle = self._capturing(token)
            try:
                graph = self._end_stream_capture()
            except ProviderError as error:
                self._discarded()
                raise self._capture_failure(error) from None
            finally:
                lifecycle.capturing = False
                self._active = None
            try:
                executable = self._check(self.device.driver.cuGraphInstantiate(graph, 0), "cuGraphInstantiate")
            except ProviderError:
                self._discarded()
                self._check(self.device.driver.cuGraphDestroy(graph), "cuGraphDestroy")
                raise
            self.instantiated += 1
            prologues = self.validation.recorded_prologues() if self.validation is not None else ()
            lane = self.device
            segment = _Segment(graph, executable, prologues, tuple(lane.captured_reads), tuple(lane.captured_writes))
            lifecycle.segments.append(segment)
            lifecycle.reads = tuple({*lifecycle.reads, *segment.reads})
            lifecycle.writes = tuple({*lifecycle.writes, *segment.writes})
            lane.record_graph(segment, self, lifecycle.token(), lane, (*segment.reads, *segment.writes))

    def abort(self, token) -> None:
        """End the capture ``token`` names without installing it; earlier segments stay until reset.

        Nothing is in progress: no-op. A stale token while a newer generation captures: refused, and the
        newer capture is left alone.
        """
        with self._lock:
            lifecycle = self._lookup(token)
            if lifecycle is None or not lifecycle.capturing:
                return
            if not lifecycle.names(token):
                raise InvalidArgumentError(
                    f"{NAME}: {token!r} is stale: the capture in progress is generation {lifecycle.generation}; "
                    f"abort it with its own token"
                )
            self._discard_capture(lifecycle)
        self.device.settle_capture()

    def _discarded(self) -> None:
        if self.validation is not None:  # the prologues the capture recorded never run: pending again
            self.validation.capture_discarded()

    def _discard_capture(self, lifecycle: _Lifecycle) -> None:
        lifecycle.capturing = False
        self._active = None
        self._discarded()
        try:
            graph = self._end_stream_capture()
        except ProviderError:
            return  # an invalidated capture ends with an error and no graph: nothing left to discard
        self._check(self.device.driver.cuGraphDestroy(graph), "cuGraphDestroy")

    # -- replay and liveness ------------------------------------------------------------------------
    def replay(self, token) -> None:
        with self._lock:
            lifecycle = self._installed(token)
            self._refuse_while_capturing()
            self._order(lifecycle.reads, lifecycle.writes)
            for segment in lifecycle.segments:
                self._launch(segment)

    def replay_segment(self, token, index: int) -> None:
        with self._lock:
            lifecycle = self._installed(token)
            if not 0 <= index < len(lifecycle.segments):
                raise InvalidArgumentError(
                    f"{NAME}: segment {index} does not exist; generation {lifecycle.generation} has "
                    f"{len(lifecycle.segments)} segment(s), indexed from 0 in capture order"
                )
            self._refuse_while_capturing()
            segment = lifecycle.segments[index]
            self._order(segment.reads, segment.writes)
            self._launch(segment)

    def _order(self, reads: tuple, writes: tuple) -> None:
        """Order a launch after other lanes' use of the memory its graph recorded (events, no host wait)."""
        lane = self.device
        lane.run_access = ((), ())  # the run's call named these: nothing is left for a later capture
        if reads or writes:
            lane.order_access(reads, writes)

    def _refuse_while_capturing(self) -> None:
        if self._active is not None:  # the launch would be recorded into that capture instead of running
            raise ProviderError(f"{NAME}: cannot replay a device graph while a capture is in progress; end it first")

    def _launch(self, segment: _Segment) -> None:
        validation = self.validation
        repeated = validation.before_graph(segment.prologues) if validation is not None else None
        self.device._bind()
        with self.device.capture_gate():
            result = self.device.driver.cuGraphLaunch(segment.executable, self.device.compute)
        self.device._check(result, "cuGraphLaunch(compute stream)")
        if repeated:
            validation.after_graph(repeated)

    def capturing(self, token) -> bool:
        """Whether the generation ``token`` names is being captured (a free of memory it recorded must wait)."""
        with self._lock:
            lifecycle = self._lookup(token)
            return bool(lifecycle is not None and lifecycle.names(token) and lifecycle.capturing)

    def has(self, token) -> bool:
        with self._lock:
            lifecycle = self._lookup(token)
            return bool(lifecycle is not None and lifecycle.names(token) and lifecycle.segments
                        and not lifecycle.capturing)

    def segment_count(self, token) -> int:
        with self._lock:
            return len(self._installed(token).segments)

    # -- teardown -----------------------------------------------------------------------------------
    def reset(self, token) -> bool:
        """Destroy exactly the generation ``token`` names; False for a stale, foreign or empty token."""
        with self._lock:
            lifecycle = self._lookup(token)
            if lifecycle is None or not lifecycle.names(token):
                return False
            if lifecycle.capturing:
                raise ProviderError(
                    f"{NAME}: generation {token.generation} of owner {token.owner.id} slot {token.slot.name} "
                    f"is still capturing; abort the capture before resetting it"
                )
            return self._destroy(lifecycle)

    def retire(self, owner) -> None:
        """Drop every lifecycle of ``owner`` (aborting and destroying whatever is left)."""
        with self._lock:
            for key in [k for k in self._lifecycles if k[0] == owner]:
                lifecycle = self._lifecycles.pop(key)
                if lifecycle.capturing:
                    self._discard_capture(lifecycle)
                self._destroy(lifecycle)
        if not self.device.closed:
            self.device.settle_capture()

    def close(self) -> None:
        with self._lock:
            # A capture still open is ended first: until then its thread may not destroy graphs (a GPU refuses
            # cuGraphExecDestroy there, and an open capture would refuse this thread's later work too).
            if self._active is not None:
                self._discard_capture(self._active)
            for owner in {key[0] for key in self._lifecycles}:
                self.retire(owner)
