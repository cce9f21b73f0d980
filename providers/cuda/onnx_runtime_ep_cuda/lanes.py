"""Lanes: one provider instance's streams on the shared :class:`~.device.CudaDevice`, and the ordering of device
buffers that several lanes touch.

A :class:`Lane` is a compute and a transfer stream with the state that goes with them (which allocations a
transfer must wait for, the capture in progress, the frees held back by it). Every provider instance (so every
session) gets one from :meth:`CudaDevice.open_lane`, and the kernels, copies, allocations, fences and device
graphs of that instance run on it, so two sessions on two threads keep the device busy side by side instead
of queueing on one stream. A lane's *gate* is held for the length of one driver call on its streams, and by
the capturing thread for the whole of a capture (see :meth:`CudaDevice.begin_capture`): another thread's work
on that lane waits for the capture to end rather than landing in the graph; other lanes do not wait. Closing
an instance returns its lane to the device, which hands it to the next instance (tensors outliving a session
still free on its streams), so a process holds as many lanes as it ever had instances open at once.

Ordering. Work on one lane is ordered by its stream; across lanes nothing is, so a buffer one lane wrote and another
reads (an output of session A fed to session B, a bound output, a DeviceIoBinding handed over) needs an event.
:class:`AccessMarks` remembers, per allocation that another lane touched, its last writer and the lanes that read it
since; an access (``CudaDevice.order_access``) makes the accessing lane wait for the writer (a read), or for the
writer and every reader (a write; a reader that waited for this write does not wait again), and a free waits for
them too. The event is recorded on the other lane when the access happens (everything it queued so far, the buffer's
use included) and goes back to the device's idle events at once, so no event is kept per buffer. A lane that is
capturing is never recorded on (its graph's work runs at a replay, which orders itself again): the event recorded
just before its capture began stands for it. A lane that is capturing does not wait either (a captured stream cannot
wait on an event from outside the capture), nor mark anything (nothing runs yet): it records the keys instead, and
each launch of the graph (the first, right after the capture, and every replay) orders them (access.py keeps these
records, the owners of borrowed memory and the graphs that recorded an address).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field


@dataclass(eq=False)
class AccessMarks:
    """Who touched one allocation last: the lane that wrote it (None: its home, the lane that allocated it) and
    the lanes that read it since."""

    writer: object = None
    readers: list = field(default_factory=list)
    settled: bool = False  # the home lane's sync waited for this write (access.foreign_writers)


class Lane:
    """See the module docstring. Attributes a lane does not define come from the shared device, so kernels and
    helpers use a lane wherever they used the device."""

    def __init__(self, shared, compute, transfer):
        self.shared = shared
        self.compute = compute
        self.transfer = transfer
        self.gate = threading.RLock()
        # Pool memory is ordered on the compute stream: a transfer touching a buffer allocated since the last
        # join must first wait for compute, and a free must wait for transfers still in flight.
        self.allocated_since_join = False
        self.transfer_since_join = False
        self.capture_thread: int | None = None
        # From begin_capture until the capture's graph is recorded or discarded (CudaDevice.settle_capture): releases
        # of memory the capture reached (frees, ends of borrows, reserved releases) wait for that point.
        self.capture_open = False
        self.releases_after_record: list = []
        self.captured_bases: set[int] = set()  # allocated during the capture: the graph's own memory
        self.frees_after_capture: list[tuple] = []  # (base, nbytes, stream, home)
        self.precapture = None  # an event recorded on compute just before the capture in progress began
        # Keys the capture in progress ordered (access.py), and those of the run's order_device_access call just
        # before it: the graph replays order them again.
        self.captured_reads: set[int] = set()
        self.captured_writes: set[int] = set()
        self.run_access: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())

    def __getattr__(self, name):
        return getattr(self.shared, name)

    @property
    def driver(self):
        return self.shared.driver

    @driver.setter
    def driver(self, value) -> None:  # one driver per device: a wrapper set here (a counting one) serves every lane
        self.shared.driver = value

    def _on(self, stream):
        return self.compute if stream is None else stream

    # -- the device's calls on this lane's streams ----------------------------------------------------
    def allocate(self, size: int, alignment: int = 256, stream=None):
        return self.shared.allocate(size, alignment, self._on(stream), lane=self)

    def free(self, base: int, stream=None) -> None:
        self.shared.free(base, self._on(stream))

    def upload(self, dst: int, src) -> None:
        self.shared.upload(dst, src, lane=self)

    def download(self, dst, src: int) -> None:
        self.shared.download(dst, src, lane=self)

    def copy_device(self, dst: int, src: int, nbytes: int, stream=None) -> None:
        self.shared.copy_device(dst, src, nbytes, self._on(stream), lane=self)

    def copy_rows(self, dst, dst_pitch, src, src_pitch, width, height, stream=None) -> None:
        self.shared.copy_rows(dst, dst_pitch, src, src_pitch, width, height, self._on(stream), lane=self)

    def copy_async(self, dst, src, nbytes: int):
        return self.shared.copy_async(dst, src, nbytes, lane=self)

    def fill(self, dst: int, nbytes: int, value: int = 0, stream=None) -> None:
        self.shared.fill(dst, nbytes, value, self._on(stream), lane=self)

    def launch(self, function, grid, block, args, shared_bytes: int = 0, stream=None) -> None:
        self.shared.launch(function, grid, block, args, shared_bytes, self._on(stream), lane=self)

    def launch_split(self, function, grid, block, values, types, shared_bytes: int = 0, stream=None) -> None:
        self.shared.launch_split(function, grid, block, values, types, shared_bytes, self._on(stream), lane=self)

    def wait_fence(self, fence) -> None:
        self.shared.wait_fence(fence, lane=self)

    def copy_wait_fence(self, fence) -> None:
        self.shared.copy_wait_fence(fence, lane=self)

    def record_compute_fence(self):
        return self.shared.record_compute_fence(lane=self)

    def sync(self) -> None:
        self.shared.sync(lane=self)

    def begin_capture(self) -> None:
        self.shared.begin_capture(lane=self)

    def end_capture(self) -> None:
        self.shared.end_capture(lane=self)

    def settle_capture(self) -> None:
        self.shared.settle_capture(lane=self)

    def sync_session(self) -> None:
        self.shared.sync_session(self)

    def capturing_here(self) -> bool:
        return self.capture_thread == threading.get_ident()

    def capture_gate(self):
        return self.gate

    def order_access(self, reads=(), writes=()) -> int:
        return self.shared.order_access(self, reads, writes)

    def lend(self, start: int, nbytes: int) -> None:
        self.shared.lend(self, start, nbytes)
