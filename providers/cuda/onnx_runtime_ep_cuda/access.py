"""Who touched device memory, across the lanes of one :class:`~.device.CudaDevice`: the marks that order one lane's
work after another's (lanes.py explains the rule), the owners of borrowed memory, and the device graphs that
recorded an address.

Keys. A pool allocation is known by its base, and so is every address inside it (an alias, or external memory
bound at an offset of it: found by an interval lookup), so whoever touches part of it is ordered against whoever
touched the whole. A reserved allocation is known by the object holding it (``note_home``), and so is every
address of its reserved range (the same interval lookup). Memory a session
borrowed (external memory bound through a ``DeviceIoBinding``, outside any allocation here) is lent by
:meth:`AccessOrdering.lend`: its home is the lane of the instance that borrowed it, for as long as the borrow
lasts, and every address inside it is keyed by its start, so a reader at an offset waits for a writer of the whole.
Memory of none of these (a block of a capture arena) still takes the first lane that orders it as its home, and its
marks go with the allocation holding it.

Host waits. A session's sync waits for its own lane, and for the lanes whose last write into memory homed on its
lane it has not waited for yet (:meth:`AccessOrdering.foreign_writers`), not for every lane of the device. The end
of a borrow waits on the host for the lanes that touched the memory, since the caller may reuse it at once.

Graph records. A capture notes the keys it ordered (the run's feeds and bound outputs, ordered just before it,
and every buffer a hook reached inside it: a bound output's copy, a decode step's argmax and token writer), so each
replay orders them again on its own (event waits, no host synchronization) and the lanes that read or write them
later wait for the replay. Freeing such memory, or ending its borrow, while a graph of another lane that recorded
it is installed resets that graph (its session captures afresh at its next run) instead of leaving it to replay on
memory the pool may hand out again. Releasing memory a capture in progress reached (a free, the end of a borrow, a
reserved release) is held until that capture's graph is recorded (:meth:`AccessOrdering.hold_for_capture`), then
resets it.
"""

from __future__ import annotations

import bisect
import threading

from onnx_runtime.errors import ProviderError

from .lanes import AccessMarks

NAME = "CUDAExecutionProvider"


class AccessOrdering:
    """The part of :class:`~.device.CudaDevice` that orders lanes by the memory they touch (see the module
    docstring). Expects ``_lock``, ``_live``, ``_lanes``, ``compute`` and ``_order_after`` of the device."""

    def _init_access(self) -> None:
        self._marks: dict[int, AccessMarks] = {}  # key -> who touched it, for memory another lane touched
        self._homes: dict[int, object] = {}  # key -> its home stream, where that is not the default lane's
        self._loose: set[int] = set()  # keys of marks on memory of no allocation here (addresses inside one)
        self._lent: dict[int, list] = {}  # start of borrowed memory -> [end, borrows outstanding]
        self._recorded: dict[int, dict[int, tuple]] = {}  # key -> id(record) -> (graphs, token, lane)
        self._ranges: dict[int, tuple[int, int]] = {}  # start of a reserved range -> (its end, its key)
        self._range_starts: list[int] = []  # the keys of _ranges, sorted
        self.ordered_waits = 0  # cross-lane event waits enqueued by order_access and frees

    def _clear_access(self) -> None:
        for table in (self._marks, self._homes, self._loose, self._lent, self._recorded, self._ranges):
            table.clear()
        self._range_starts.clear()

    # -- keys -----------------------------------------------------------------------------------------
    def _resolve(self, key: int) -> int:
        """The key of the memory ``key`` addresses: the base of the live allocation holding it, the start of the
        borrowed memory holding it, else itself. Called under ``_lock``."""
        if key in self._live or key in self._marks or key in self._homes:
            return key
        base = self._owning_base(key)
        if base is not None:
            return base
        owner = self._reserved_owner(key)
        if owner is not None:
            return owner
        for start, (end, _count) in self._lent.items():
            if start <= key < end:
                return start
        return key

    def _owning_base(self, address: int) -> int | None:
        """The base of the live allocation whose bytes hold ``address``, or None. Called under ``_lock``."""
        starts = self._live_starts
        index = bisect.bisect_right(starts, address) - 1
        if index < 0:
            return None
        base = starts[index]
        return base if address < base + self._live[base] else None

    def _reserved_owner(self, address: int) -> int | None:
        """The key of the reserved allocation whose range holds ``address``, or None. Called under ``_lock``."""
        index = bisect.bisect_right(self._range_starts, address) - 1
        if index < 0:
            return None
        end, owner = self._ranges[self._range_starts[index]]
        return owner if address < end else None

    def resolve_keys(self, keys) -> list[int]:
        with self._lock:
            return [self._resolve(k) for k in keys]

    def note_home(self, key: int, lane, start: int = 0, nbytes: int = 0) -> None:
        """Memory ``key`` names (not a pool allocation: a reserved one, whose addresses are ``[start, start +
        nbytes)``) is ``lane``'s, for :meth:`order_access`."""
        with self._lock:
            self._homes[key] = lane.compute
            if nbytes:
                self._ranges[start] = (start + nbytes, key)
                bisect.insort(self._range_starts, start)

    def forget_access(self, key: int, then=None) -> None:
        """Drop what :meth:`order_access` remembers of memory released without :meth:`free` (a reserved allocation),
        resetting the graphs of other lanes that recorded it, then call ``then`` (the release itself). While a
        capture that reached the memory is open, both wait for its end (:meth:`hold_for_capture`)."""
        with self._lock:
            records = self._records_in(key, key + 1, self._homes.get(key, self.compute))
        if self.hold_for_capture(records, lambda: self.forget_access(key, then)):
            return
        self._reset_records(records, key, "its release")
        with self._lock:
            self._marks.pop(key, None)
            self._homes.pop(key, None)
            self._loose.discard(key)
            for start in [s for s, (_end, owner) in self._ranges.items() if owner == key]:
                del self._ranges[start]
                self._range_starts.pop(bisect.bisect_left(self._range_starts, start))
        if then is not None:
            then()

    # -- borrowed memory --------------------------------------------------------------------------------
    def lend(self, lane, start: int, nbytes: int) -> None:
        """``lane``'s instance borrowed ``nbytes`` at ``start``: it is the memory's home until :meth:`end_loan`.
        Memory a live allocation starts is that allocation's already; an overlapping loan of the same start is
        counted and keeps the first borrower as home."""
        with self._lock:
            if self._owning_base(start) is not None or self._reserved_owner(start) is not None:
                return  # inside an allocation here: ordered as part of it
            loan = self._lent.get(start)
            if loan is not None:
                loan[0], loan[1] = max(loan[0], start + max(nbytes, 1)), loan[1] + 1
                return
            self._drop_marks(start, start + max(nbytes, 1))  # what lanes ordered before the borrow was not this
            self._lent[start] = [start + max(nbytes, 1), 1]
            self._homes[start] = lane.compute

    def end_loan(self, start: int) -> None:
        """One borrow of the memory at ``start`` ended (its session synchronized): once the last one has, forget
        its home and marks, and reset the graphs of other lanes that recorded it."""
        with self._lock:
            loan = self._lent.get(start)
            if loan is None:
                return
            if loan[1] > 1:
                loan[1] -= 1
                return
            home = self._homes.get(start, self.compute)
            records = self._records_in(start, loan[0], home)
            touched = self._touching(start, loan[0], home)
        self._host_wait(touched)  # the caller may reuse the memory once this returns: no lane may still use it
        if self.hold_for_capture(records, lambda: self.end_loan(start)):
            return  # a capture reached it: its graph is reset, and the loan forgotten, once it is recorded
        self._reset_records(records, start, "the end of its borrow")
        with self._lock:
            end, _count = self._lent.pop(start)
            self._homes.pop(start, None)
            self._drop_marks(start, end)

    def _touching(self, start: int, end: int, home) -> list:
        """The streams other than ``home`` that wrote or read memory in ``[start, end)`` since it was last waited
        for. Under ``_lock``."""
        streams: dict[int, object] = {}
        for key in [start, *(k for k in self._loose if start < k < end)]:
            marks = self._marks.get(key)
            if marks is not None:
                for stream in (marks.writer, *marks.readers):
                    if stream is not None and stream is not home:
                        streams[id(stream)] = stream
        return list(streams.values())

    def wait_for_users(self, lane, key: int) -> None:
        """Block until ``lane`` and every other lane that touched the memory ``key`` names ran what they queued (a
        release the device does not order on a stream: unmapping a reserved allocation)."""
        with self._lock:
            touched = self._touching(key, key + 1, lane.compute)
        self.sync(lane)
        self._host_wait(touched)

    def foreign_writers(self, lane) -> list:
        """The streams of other lanes whose last write into memory homed on ``lane`` (its allocations, what it
        borrowed) ``lane`` has not waited for yet: what its sync must wait for besides its own streams. Each is
        noted as waited for."""
        stream = lane.compute
        writers: dict[int, object] = {}
        with self._lock:
            for key, marks in self._marks.items():
                writer = marks.writer
                if writer is None or writer is stream or marks.settled or self._homes.get(key, self.compute) \
                        is not stream:
                    continue
                writers[id(writer)] = writer
                marks.settled = True
        return list(writers.values())

    def _drop_marks(self, start: int, end: int) -> None:
        self._marks.pop(start, None)
        if self._loose:
            for key in [k for k in self._loose if start <= k < end]:
                self._loose.discard(key)
                self._marks.pop(key, None)

    # -- ordering -------------------------------------------------------------------------------------
    def order_access(self, lane, reads=(), writes=()) -> int:
        """Order ``lane``'s next work after other lanes' use of the memory ``reads`` and ``writes`` name (keys:
        an allocation's base, else any stable key of borrowed memory): a read waits for the last writer, a write
        for the writer and every reader since. A lane capturing on this thread records the keys for its graph instead
        (its launches order them). Returns the number of waits enqueued. See lanes.py."""
        waits: dict[int, object] = {}
        stream = lane.compute
        with self._lock:
            reads, writes = [self._resolve(k) for k in reads], [self._resolve(k) for k in writes]
            if lane.capture_thread == threading.get_ident():
                # Nothing runs yet: the launch after the capture, and every replay, make these accesses (graphs.py).
                lane.captured_reads.update(reads)
                lane.captured_writes.update(writes)
                return 0
            for base in (*reads, *writes):
                if base not in self._marks and base not in self._homes and base not in self._live:
                    # Memory of no allocation or loan here (a block of a capture arena): the first lane that
                    # orders it stands as its home; its owner's kernels reach it through that lane.
                    self._marks[base] = AccessMarks(stream)
                    self._loose.add(base)
            for base in reads:
                self._mark_read(base, stream, waits)
            for base in writes:
                self._mark_write(base, stream, waits)
        if waits:
            with lane.gate:
                for other in waits.values():
                    self._order_after(other, stream)
        return len(waits)

    def _mark_read(self, base: int, stream, waits: dict) -> None:
        marks = self._marks.get(base)
        writer = marks.writer if marks is not None else self._homes.get(base, self.compute)
        if writer is stream or (marks is not None and any(r is stream for r in marks.readers)):
            return  # its own write, or a reader that waited for this write already (a write clears the readers)
        waits[id(writer)] = writer
        if marks is None:
            marks = self._marks[base] = AccessMarks(writer)
        marks.readers.append(stream)

    def _mark_write(self, base: int, stream, waits: dict) -> None:
        marks = self._marks.get(base)
        home = self._homes.get(base, self.compute)
        if marks is None and home is stream:
            return
        for other in [home] if marks is None else [marks.writer or home, *marks.readers]:
            if other is not stream:
                waits[id(other)] = other
        if marks is None:
            marks = self._marks[base] = AccessMarks()
        marks.writer, marks.readers, marks.settled = stream, [], False

    # -- device graphs that recorded an address -----------------------------------------------------------
    def record_graph(self, record: object, graphs, token, lane, keys) -> None:
        """A graph generation of ``lane`` (``token`` of ``graphs``) recorded ``keys``; ``record`` stands for it
        until :meth:`forget_graph`."""
        with self._lock:
            for key in keys:
                self._recorded.setdefault(key, {})[id(record)] = (graphs, token, lane)

    def forget_graph(self, record: object, keys) -> None:
        with self._lock:
            for key in keys:
                holders = self._recorded.get(key)
                if holders is not None:
                    holders.pop(id(record), None)
                    if not holders:
                        del self._recorded[key]

    def _records_in(self, start: int, end: int, home) -> list[tuple]:
        """The graphs of lanes other than ``home``'s that recorded memory in ``[start, end)``, and ``(None, lane)``
        for such a lane whose capture in progress (or ended, its graph not yet recorded) reached it. Under
        ``_lock``."""
        found: dict[int, tuple] = {}
        for key in [k for k in self._recorded if start <= k < end] if self._recorded else ():
            for ident, (graphs, token, lane) in self._recorded[key].items():
                if lane.compute is not home:
                    found[ident] = (graphs, token)
        for lane in self._lanes.values():
            if lane.capture_open and lane.compute is not home and any(
                    start <= k < end for k in (*lane.captured_reads, *lane.captured_writes)):
                found[id(lane)] = (None, lane)
        return list(found.values())

    def hold_for_capture(self, records: list[tuple], release) -> bool | None:
        """Queue ``release`` on a lane among ``records`` whose capture reached the memory and is still open (in
        progress, or ended with its graph not yet recorded): it runs once that graph is recorded or discarded
        (``CudaDevice.settle_capture``), when the graph is there to reset. True when queued; None when no capture
        is among the records; False when those captures closed meanwhile (their graphs are records now)."""
        capturing = [lane for graphs, lane in records if graphs is None] + [
            graphs.device for graphs, token in records if graphs is not None and graphs.capturing(token)]
        if not capturing:
            return None
        with self._order_lock:
            lane = next((each for each in capturing if each.capture_open), None)
            if lane is None:
                return False
            lane.releases_after_record.append(release)
            return True

    def _reset_records(self, records: list[tuple], start: int, why: str) -> None:
        for graphs, token in records:
            if graphs is None or graphs.capturing(token):
                raise ProviderError(
                    f"{NAME}: the device memory at {start:#x} cannot be released ({why}) while another session is "
                    f"capturing a device graph that recorded its address; release it after that capture ends"
                )
        for graphs, token in records:
            graphs.reset(token)  # a generation captured since is not this one: reset leaves it alone
