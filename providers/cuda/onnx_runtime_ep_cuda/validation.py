"""Deferred device validation: a 32-bit flag word on the device that kernels raise bits in.

A kernel that meets invalid data (a Gather index out of range, ...) does not fault or write out of
bounds: it skips the element and ``atomicOr``s a bit into the *current flag word*, whose address it
gets from ``KernelContext.validation_flags()`` at launch. The flags are read at the next host-visible
boundary, so validation costs no synchronization of its own.

Owners and generations (the contract's deferred-validation hooks). Each executor (or persistent
binding) registers an owner once; the owner gets its own device word. ``begin`` opens a generation:
it clears the word (stream-ordered, before the work it validates) and makes it the current word, so
the generation's kernels, and any device graph captured while it was current, raise bits there.
``activate`` seals the submission; ``consume`` (after the caller's host sync) reads the word once and
keeps the result sticky, so every exact consumer sees the same flags. Only the latest generation of a
registered owner can be consumed: a foreign owner's or an older generation's token is refused.
An output binding added as a *recipient* gets its own token that resolves to the submission's result.

Nothing is read before the next host-visible read. A ``begin`` that finds the owner's previous generation
still open (its flags left to recipients that have not read them yet) does not read the word: it *carries*
it. Every word is a pair: the flag word, then its *carry word*. A generation's *prologue* is one kernel
(kernels/validation.cu ``carry_and_clear``) that moves the flag word into the carry word and clears the flag
word; the recipients of the carried generation read the carry word when they consume. A recipient still
reading a carry word when the owner closes another generation is first given a copy in a word of its own
(*evacuated*); in a decode loop the same bindings receive every step, so nobody is left to evacuate. The
submitter's old token is stale either way. A decode loop whose bindings are read only at the end therefore
runs every step without a host read.

The prologue is enqueued lazily, by whatever touches the flag word first: a kernel asking for the current word,
a read, an evacuation, the next ``begin``. A device graph capture that asks for the word records the prologue
into the graph (graphs.py keeps, per segment, the owners whose prologue it recorded): a replay then *claims* the
pending prologue instead of enqueuing it, so a replayed decode step is one graph launch with its validation
begun inside it. A replay whose owner already had its prologue enqueued in this generation keeps the flags the
recorded prologue would move (evacuate before the launch, ``merge_carry`` after it).

The word of an owner stays at one address for the owner's lifetime: a graph captured in one
generation keeps raising into it when replayed in later ones (each replay's generation clears it
first). Generations nest (a subgraph executor run by a control-flow kernel opens its own while its
parent's is open): the current word is the innermost open generation's. With none open, kernels
write a provider-wide word that nobody consumes (read it with :meth:`DeviceValidation.unscoped_flags`).

An owner whose word was never handed to a kernel needs no clearing and no read, so a run without
validating kernels pays nothing.

Under the process's memory governor (the provider's ``adopt_memory_governor``, governance.py) every word is charged
to the device tier, role workspace, before it is allocated, and its charge is given back when it is freed, once.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

import numpy as np
from onnx_runtime.contract.residency import MemoryLease, MemoryRole, Tier
from onnx_runtime.contract.validation import DeviceValidationOwner, DeviceValidationRegistration, DeviceValidationToken
from onnx_runtime.errors import InvalidArgumentError, ProviderError

NAME = "CUDAExecutionProvider"
WORD_BYTES = 4
PAIR_BYTES = 2 * WORD_BYTES  # a flag word and its carry word, in one allocation

# _Owner.pending: whether the generation's prologue still has to run.
_PENDING = 1  # not enqueued yet
_RECORDED = 2  # recorded into the device graph being captured, which runs it when launched

# Bits kernels raise (atomicOr) in the flag word.
INDEX_OUT_OF_RANGE = 1 << 0  # an index (Gather, GatherElements, ScatterND, ...) outside its axis
INVALID_ARGUMENT = 1 << 1  # another data-dependent argument outside what the operator accepts

FLAG_NAMES = {INDEX_OUT_OF_RANGE: "index out of range", INVALID_ARGUMENT: "invalid argument"}


def describe(flags: int) -> str:
    """``flags`` in words, e.g. "index out of range"."""
    names = [name for bit, name in FLAG_NAMES.items() if flags & bit]
    unknown = flags & ~sum(FLAG_NAMES)
    if unknown:
        names.append(f"unknown bits 0x{unknown:x}")
    return ", ".join(names) or "none"


def _same_view(one, other) -> bool:
    """Whether two adopted governors are one process governor's view of one device."""
    return getattr(one, "process", one) is getattr(other, "process", other) and \
        getattr(one, "device", None) == getattr(other, "device", 0)


@dataclass(eq=False)
class _Owner:
    """Provider-private state of one registration."""

    validator: DeviceValidation
    owner: DeviceValidationOwner
    address: int = 0  # the owner's flag word on the device (allocated at its first submission)
    base: int = 0  # the allocation to free
    used: bool = False  # the word's address was handed to a kernel, so it must be cleared and read
    generation: int = 0  # the latest token minted for this owner
    open: bool = False  # a submission of `generation` is running and not yet consumed
    activated: bool = False
    result: int | None = None  # the sticky flags of `generation`, once known
    recipients: list[_Owner] = field(default_factory=list)  # recipients of the open submission
    source: tuple[_Owner, int] | None = None  # for a recipient token: the submission it resolves to
    snapshot: bool = False  # a recipient whose carried flags wait in its own word (evacuated)
    registered: bool = True
    pending: int = 0  # the prologue of `generation`: 0 (ran or not needed), _PENDING or _RECORDED
    carries: int = 0  # how many generations this owner has carried (the carry word holds the latest)
    dependents: list[_Owner] = field(default_factory=list)  # recipients reading the carry word
    carried: tuple[_Owner, int] | None = None  # for a recipient: (owner, carry) whose carry word holds its flags


class DeviceValidation:
    """The validation state of one provider instance (see the module docstring)."""

    def __init__(self, device):
        self.device = device
        self._lock = threading.RLock()
        self._owners: dict[DeviceValidationOwner, _Owner] = {}
        self._open: list[_Owner] = []  # open generations, innermost last: the last one's word is current
        self._unscoped: tuple[int, int] | None = None  # (address, base) of the word used outside submissions
        self._recorded: list[_Owner] = []  # owners whose prologue the capture in progress recorded
        self._kernels: dict[str, object] = {}  # validation.cu's functions, loaded before any capture
        # Under the memory governor (docs/memory.md): each word's lease, by its allocation's base.
        self._governor = None
        self._holder = None
        self._leases: dict[int, MemoryLease] = {}

    # -- governance -------------------------------------------------------------------------------------
    def govern(self, governor, holder) -> int:
        """Charge the words (those allocated already, and every later one) to ``governor``'s device tier for
        ``holder``, role workspace; returns the bytes charged now. Adopting the same governor again charges
        nothing; another one takes the charges over."""
        with self._lock:
            if self._governor is not None and _same_view(self._governor, governor):
                return 0
            leases, self._leases = self._leases, {}
            for lease in leases.values():
                lease.release()
            self._governor, self._holder = governor, holder
            for base in self._bases():
                self._leases[base] = governor.reserve(PAIR_BYTES, Tier.DEVICE, MemoryRole.WORKSPACE, holder)
            return PAIR_BYTES * len(self._leases)

    @property
    def charged(self) -> int:
        """The device bytes the words have charged to the governor."""
        with self._lock:
            return sum(lease.nbytes for lease in self._leases.values())

    def _bases(self) -> list[int]:
        bases = [state.base for state in self._owners.values() if state.base]
        return bases + ([self._unscoped[1]] if self._unscoped is not None else [])

    # -- words ------------------------------------------------------------------------------------------
    def _allocate_word(self) -> tuple[int, int]:
        """A cleared word pair, charged before the driver is asked (a budget that cannot take it refuses here)."""
        lease = self._governor.reserve(PAIR_BYTES, Tier.DEVICE, MemoryRole.WORKSPACE, self._holder) \
            if self._governor is not None else None
        try:
            address, base = self.device.allocate(PAIR_BYTES)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        if lease is not None:
            self._leases[base] = lease
        self.device.fill(address, PAIR_BYTES, 0)
        return address, base

    def _free_word(self, base: int) -> None:
        """Free a word's allocation and give its charge back, once."""
        lease = self._leases.pop(base, None)
        try:
            if not self.device.closed:
                self.device.free(base)
        finally:
            if lease is not None:
                lease.release()

    def _read(self, address: int) -> int:
        word = np.zeros(1, np.uint32)
        self.device.download(word.view(np.uint8), address)  # waits for the compute stream
        return int(word[0])

    def _words(self, kernel: str, address: int) -> None:
        function = self._kernels.get(kernel)
        if function is None:
            device = self.device
            function = self._kernels[kernel] = device.function(device.load("validation.cu"), kernel)
        self.device.launch(function, 1, 1, [(address, ctypes.c_void_p)])

    def _prologue(self, state: _Owner) -> None:
        """Enqueue ``state``'s pending prologue now (into the capture in progress on this thread, if any)."""
        self._words("carry_and_clear", state.address)
        if self.device.capturing_here():
            state.pending = _RECORDED
            self._recorded.append(state)
        else:
            state.pending = 0

    def _settle(self, state: _Owner) -> None:
        """The prologue of ``state`` enqueued (eagerly) before what comes next touches its words."""
        if state.pending:
            self._words("carry_and_clear", state.address)
            state.pending = 0

    def _evacuate(self, state: _Owner) -> None:
        """Give each recipient still reading ``state``'s carry word a copy in its own word (before a later prologue
        overwrites the carry word)."""
        for recipient in state.dependents:
            if recipient.carried != (state, state.carries) or not recipient.registered:
                continue
            if not recipient.address:
                recipient.address, recipient.base = self._allocate_word()
            self.device.copy_device(recipient.address, state.address + WORD_BYTES, WORD_BYTES)
            recipient.carried, recipient.snapshot = None, True
        state.dependents = []

    def current_word(self) -> int:
        """The device address kernels raise flags in now (see the module docstring)."""
        with self._lock:
            if self._open:
                state = self._open[-1]
                state.used = True
                if state.pending == _PENDING:
                    self._prologue(state)
                return state.address
            if self._unscoped is None:
                self._unscoped = self._allocate_word()
            return self._unscoped[0]

    def prepare(self) -> None:
        """Allocate the word used outside submissions and load the prologue's kernels now (before a capture, where
        allocating and loading modules are illegal)."""
        with self._lock:
            if self._unscoped is None:
                self._unscoped = self._allocate_word()
            if not self._kernels:
                for kernel in ("carry_and_clear", "merge_carry"):
                    self._kernels[kernel] = self.device.function(self.device.load("validation.cu"), kernel)

    def unscoped_flags(self, reset: bool = True) -> int:
        """Flags raised by kernels that ran outside any submission (synchronizes); cleared by default."""
        with self._lock:
            if self._unscoped is None:
                return 0
            flags = self._read(self._unscoped[0])
            if reset and flags:
                self.device.fill(self._unscoped[0], WORD_BYTES, 0)
            return flags

    # -- device graphs ----------------------------------------------------------------------------------
    def recorded_prologues(self) -> tuple[_Owner, ...]:
        """The owners whose prologue the capture that just ended recorded (graphs.py keeps them per segment)."""
        with self._lock:
            recorded, self._recorded = tuple(self._recorded), []
            return recorded

    def capture_discarded(self) -> None:
        """The capture in progress was dropped: the prologues it recorded never run, so they are pending again."""
        with self._lock:
            for state in self._recorded:
                if state.pending == _RECORDED:
                    state.pending = _PENDING
            self._recorded = []

    def before_graph(self, prologues: tuple[_Owner, ...]) -> list[_Owner]:
        """Before a graph launch: the pending prologues it recorded are claimed (it runs them); pending ones it did
        not record are enqueued first. Owners whose recorded prologue would run a second time in this generation
        (it was enqueued already) are returned for :meth:`after_graph`."""
        with self._lock:
            repeated = []
            for state in prologues:
                if not state.registered or not state.address:
                    continue
                if state.pending:
                    state.pending = 0
                else:
                    self._evacuate(state)  # the launch overwrites the carry word
                    repeated.append(state)
            for state in self._open:
                if state.pending == _PENDING and state not in prologues:
                    self._prologue(state)
            return repeated

    def after_graph(self, repeated: list[_Owner]) -> None:
        """After the launch: the flags raised before it, moved to the carry word, go back to the flag word."""
        with self._lock:
            for state in repeated:
                if state.registered and state.address:
                    self._words("merge_carry", state.address)

    # -- registrations ----------------------------------------------------------------------------------
    def register(self) -> DeviceValidationRegistration:
        state = _Owner(self, DeviceValidationOwner.new())
        with self._lock:
            self._owners[state.owner] = state
        return DeviceValidationRegistration(state.owner, state)

    def _state(self, registration) -> _Owner:
        state = getattr(registration, "state", None)
        if not (isinstance(registration, DeviceValidationRegistration) and isinstance(state, _Owner)
                and state.validator is self and state.registered and state.owner == registration.owner):
            raise InvalidArgumentError(
                f"{NAME}: {registration!r} is not a live validation registration of this provider (foreign or "
                f"already unregistered); register it with this provider's register_device_validation_owner"
            )
        return state

    def _submitter(self, token) -> _Owner:
        if not isinstance(token, DeviceValidationToken):
            raise InvalidArgumentError(f"{NAME}: expected a DeviceValidationToken, got {type(token).__name__}")
        state = self._owners.get(token.owner)
        if state is None:
            raise InvalidArgumentError(f"{NAME}: validation token {token!r} belongs to no owner registered here")
        if token.generation != state.generation or state.source is not None:
            raise InvalidArgumentError(
                f"{NAME}: validation token {token!r} is stale; owner {token.owner.id} is at generation "
                f"{state.generation}"
            )
        return state

    def unregister(self, registration) -> None:
        """Retire a registration and free its word; retiring one already retired here does nothing."""
        with self._lock:
            state = getattr(registration, "state", None)
            if isinstance(state, _Owner) and state.validator is self and not state.registered:
                return
            state = self._state(registration)
            if state.open:
                self._finish(state)
            if state.dependents:  # recipients still to read its carry word get theirs first
                self._settle(state)
                self._evacuate(state)
            state.registered = False
            self._owners.pop(state.owner, None)
            if state.base:
                self._free_word(state.base)
            state.address = state.base = 0

    # -- submissions ------------------------------------------------------------------------------------
    def begin(self, registration) -> DeviceValidationToken:
        with self._lock:
            state = self._state(registration)
            self._settle(state)  # a prologue nothing asked for yet runs before this generation's
            if state.open:  # the previous generation was never consumed: carry it, on the device
                self._carry(state)
            if not state.address:
                state.address, state.base = self._allocate_word()
            elif state.used:  # enqueued by what touches the word first (see the module docstring)
                state.pending = _PENDING
            state.generation += 1
            state.open, state.activated, state.result, state.source = True, False, None, None
            state.recipients = []
            self._open.append(state)
            return DeviceValidationToken(state.owner, state.generation)

    def add_recipient(self, submission, recipient) -> DeviceValidationToken:
        with self._lock:
            source = self._submitter(submission)
            if not source.open or source.activated:
                raise InvalidArgumentError(
                    f"{NAME}: recipients join a submission between begin and activate; {submission!r} is "
                    f"{'activated' if source.open else 'finished'}"
                )
            state = self._state(recipient)
            if state is source:
                raise InvalidArgumentError(f"{NAME}: a submission's owner cannot be its own recipient")
            if state.open:
                self._finish(state)
            state.generation += 1
            state.result, state.source, state.snapshot = None, (source, source.generation), False
            state.carried = None
            source.recipients.append(state)
            return DeviceValidationToken(state.owner, state.generation)

    def activate(self, submission) -> None:
        with self._lock:
            state = self._submitter(submission)
            if not state.open:
                raise InvalidArgumentError(f"{NAME}: submission {submission!r} already finished")
            state.activated = True

    def abort(self, submission) -> int:
        """Settle a submission on an error path; the flags it raised (0 if none)."""
        with self._lock:
            state = self._submitter(submission)
            if state.result is not None:
                return state.result
            return self._finish(state)

    def consume(self, registration, token) -> int:
        """The flags of exactly ``token``'s generation (sticky: every exact consumer sees the same)."""
        with self._lock:
            state = self._state(registration)
            if not isinstance(token, DeviceValidationToken) or token.owner != state.owner:
                raise InvalidArgumentError(
                    f"{NAME}: validation token {token!r} belongs to another owner than registration "
                    f"{state.owner.id}; only the submitting owner or a recipient may consume it"
                )
            if token.generation != state.generation:
                raise InvalidArgumentError(
                    f"{NAME}: validation token {token!r} is stale; owner {state.owner.id} is at generation "
                    f"{state.generation}"
                )
            if state.result is not None:
                return state.result
            if state.carried is not None or state.snapshot or state.source is not None:
                return self._recipient_result(state, token)
            if not state.open:
                raise InvalidArgumentError(f"{NAME}: validation token {token!r} names no submission")
            if not state.activated:
                raise InvalidArgumentError(
                    f"{NAME}: submission {token!r} is not activated; activate it before consuming its result"
                )
            return self._finish(state)

    def _recipient_result(self, state: _Owner, token) -> int:
        if state.carried is not None:  # a recipient of a carried submission: its owner's carry word
            source, _carry = state.carried
            self._settle(source)  # the carrying prologue runs before the read
            state.result, state.carried = self._read(source.address + WORD_BYTES), None
            return state.result
        if state.snapshot:  # an evacuated recipient: the copy of its flags in its own word
            state.result, state.snapshot = self._read(state.address), False
            return state.result
        assert state.source is not None  # a recipient: its submission's result
        source, generation = state.source
        if source.generation == generation and source.open:
            self._finish(source)
        if state.result is None:
            raise ProviderError(f"{NAME}: the submission recipient {token!r} was added to is gone")
        return state.result

    def _carry(self, state: _Owner) -> None:
        """Close the open generation without reading it: its recipients will read the carry word, where the next
        generation's prologue moves its flags (see the module docstring)."""
        self._evacuate(state)
        state.carries += 1
        for recipient in state.recipients:
            if recipient.source != (state, state.generation) or not recipient.registered:
                continue
            recipient.source = None
            if not state.used:  # no kernel raised into the word since it was last cleared
                recipient.result = 0
                continue
            recipient.carried = (state, state.carries)
            state.dependents.append(recipient)
        state.recipients = []
        state.open = False
        if state in self._open:
            self._open.remove(state)

    def _finish(self, state: _Owner) -> int:
        """Read the open generation's flags (synchronizing when the word was used) and settle it."""
        try:
            if state.pending:  # nothing touched the word this generation: its flags are none
                self._settle(state)
                flags = 0
            else:
                flags = self._read(state.address) if state.used and state.address else 0
        finally:
            state.open = False
            if state in self._open:
                self._open.remove(state)
        state.result = flags
        for recipient in state.recipients:
            if recipient.source == (state, state.generation):
                recipient.result = flags
        state.recipients = []
        return flags

    def close(self) -> None:
        """Free every word (provider shutdown); registrations left over become foreign."""
        with self._lock:
            for state in list(self._owners.values()):
                state.registered = False
                if state.base:
                    self._free_word(state.base)
                state.address = state.base = 0
            self._owners.clear()
            self._open.clear()
            if self._unscoped is not None:
                self._free_word(self._unscoped[1])
            self._unscoped = None
            for lease in self._leases.values():  # (none should be left: every word was freed above)
                lease.release()
            self._leases.clear()
