"""The device half of the execution-provider contract: on-device decoding, device graphs, deferred validation and
compiled contexts. :class:`onnx_runtime.contract.hookspecs.ExecutionProviderSpec` inherits these hooks; the
module docstring of :mod:`onnx_runtime.contract.hookspecs` says how every hook is called, defaulted and documented.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .markers import hookspec

if TYPE_CHECKING:
    from ..dtypes import DataType
    from .buffers import DeviceBuffer
    from .graphs import (
        DeviceGraphOwner,
        DeviceGraphSlot,
        DeviceGraphToken,
    )
    from .kernels import ArgmaxTieBreak, EpContext, Kernel
    from .validation import DeviceValidationRegistration, DeviceValidationToken


class DeviceExecutionSpec:
    """Hooks of a provider whose kernels run on a device: decoding steps, device graphs, validation, contexts."""

    # -- on-device greedy decoding --------------------------------------------------------------
    @hookspec(firstresult=True)
    def device_argmax_supported(self) -> bool:
        """Whether ``device_argmax`` is implemented.

        Default: True on a host-accessible device (the default ``device_argmax`` serves it), else False.
        Called by: session/device_io_binding.py (``DeviceIoBinding.device_argmax_supported``).
        """

    @hookspec(firstresult=True)
    def device_argmax(
        self,
        logits: DeviceBuffer,
        elements: int,
        batch: int,
        dtype: DataType,
        result: DeviceBuffer,
        tie_break: ArgmaxTieBreak,
    ) -> None:
        """Argmax over ``batch`` rows of ``elements`` contiguous ``dtype`` values in ``logits``.

        ``result`` receives two native-endian uint32 words per row at word ``2*row``: the index,
        then the latched device capture-error bitmask. ``tie_break`` is an
        :class:`ArgmaxTieBreak`. Allocation-free; no host synchronization.
        Default: numpy over host buffers (contract/host_decode.py; NaN ranks above every number, the second
        word is 0); :class:`NotSupportedError` for device ones.
        Called by: session/device_io_binding.py (``DeviceIoBinding.device_argmax``).
        """

    @hookspec(firstresult=True)
    def device_token_writer(
        self,
        result: DeviceBuffer,
        input_ids: DeviceBuffer,
        position_ids: DeviceBuffer,
        attention_mask: DeviceBuffer,
        scratch: DeviceBuffer,
        capacity: int,
        next_position: int,
        mask_len: int,
        write_position: bool,
        step: int,
    ) -> None:
        """Fold the token just selected by ``device_argmax`` (``result`` word 0) into the decode
        bindings, device to device: write it as int64 into ``input_ids``; if ``write_position``,
        write ``next_position`` (int64) into ``position_ids``; set ``attention_mask`` (int64) to 1
        at ``next_position`` when ``next_position < mask_len``; store the token in uint32
        ``scratch[step]``; OR ``result`` word 1 into ``scratch[capacity]``. No host sync.

        Default: numpy over host buffers (contract/host_decode.py); :class:`NotSupportedError` for device ones.
        Called by: session/device_io_binding.py (``DeviceIoBinding.device_token_writer``).
        """

    @hookspec(firstresult=True)
    def device_token_writer_at(
        self,
        result: DeviceBuffer,
        input_ids: DeviceBuffer,
        position_ids: DeviceBuffer,
        attention_mask: DeviceBuffer,
        scratch: DeviceBuffer,
        capacity: int,
        mask_len: int,
        write_position: bool,
        counter: DeviceBuffer,
    ) -> None:
        """``device_token_writer`` with the step and the next position read from the device: ``counter``
        holds two int64 words (step, next position), which it uses as ``step`` and ``next_position`` and
        then increments both. Nothing it is launched with changes from step to step, so a captured decode
        step replays it as it is. A step outside ``[0, capacity)`` or a negative position writes nothing but the
        bit 0x80000000 into ``scratch[capacity]``. Contract 1.3. No host sync.

        Default: numpy over host buffers (contract/host_decode.py); :class:`NotSupportedError` for device ones.
        Called by: generate.py (the captured decode step, through ``DeviceIoBinding.device_token_writer_at``).
        """

    @hookspec(firstresult=True)
    def device_copy_rows_at(
        self,
        src: DeviceBuffer,
        src_offset: int,
        src_pitch: int,
        dst: DeviceBuffer,
        dst_pitch: int,
        row_bytes: int,
        rows: int,
        counter: DeviceBuffer,
        word: int,
        bias: int,
        dst_unit: int,
        limit: int,
    ) -> None:
        """``device_copy_rows`` whose destination offset is read from the device: ``(counter[word] + bias) *
        dst_unit`` bytes, ``counter`` being int64 words (those of ``device_token_writer_at``). An index outside
        ``[0, limit)`` copies nothing; every destination an index in range names must lie in ``dst`` and
        not overlap the source (checked on the host). Stream-ordered; no host sync; capturable. Contract 1.3.

        Default: numpy over host buffers; :class:`NotSupportedError` for device ones.
        Called by: generate.py (the captured decode step moves its appended KV rows and mask bit with it).
        """

    # -- device graphs: single slot -------------------------------------------------------------
    @hookspec(firstresult=True)
    def begin_device_graph_capture(self, kernels: Sequence[Kernel]) -> None:
        """Begin recording the given already-compiled kernels into a device graph.

        Default: :class:`NotSupportedError`.
        Called by: contract/defaults.py, the default ``begin_device_graph_capture_in`` for the
        PRIMARY slot (so, through the owner-scoped defaults, at a capture in session/device_graphs.py).
        """

    @hookspec(firstresult=True)
    def end_device_graph_capture(self) -> None:
        """End capture and install the executable graph.

        Default: :class:`NotSupportedError`.
        Called by: contract/defaults.py, the default ``end_device_graph_capture_in`` for PRIMARY.
        """

    @hookspec(firstresult=True)
    def abort_device_graph_capture(self) -> None:
        """End an in-progress capture without installing it, leaving the stream idle so that a
        later reset succeeds.

        Default: nothing to abort.
        Called by: contract/defaults.py, the default ``abort_device_graph_capture_in`` for PRIMARY.
        """

    @hookspec(firstresult=True)
    def replay_device_graph(self) -> None:
        """Replay the installed graph (every segment, in capture order).

        Default: :class:`NotSupportedError`.
        Called by: contract/defaults.py, the default ``replay_device_graph_in`` for PRIMARY.
        """

    @hookspec(firstresult=True)
    def replay_device_graph_segment(self, index: int) -> None:
        """Replay one captured segment by its zero-based capture order.

        Default: :class:`NotSupportedError`.
        Called by: contract/defaults.py, the default ``replay_device_graph_segment_in`` for PRIMARY.
        """

    @hookspec(firstresult=True)
    def reset_device_graph(self) -> bool:
        """Destroy the installed graph; return whether one existed.

        Default: False.
        Called by: contract/defaults.py, the default ``reset_device_graph_in`` for PRIMARY.
        """

    # -- device graphs: slot-routed (defaults route PRIMARY to the single-slot hooks) ------------
    @hookspec(firstresult=True)
    def begin_device_graph_capture_in(self, slot: DeviceGraphSlot, kernels: Sequence[Kernel]) -> None:
        """Slot-parameterized ``begin_device_graph_capture``.

        Default: PRIMARY goes to ``begin_device_graph_capture``; other slots raise
        :class:`NotSupportedError` naming the provider and the slot.
        Called by: contract/defaults.py, the default ``begin_owned_device_graph_capture``.
        """

    @hookspec(firstresult=True)
    def end_device_graph_capture_in(self, slot: DeviceGraphSlot) -> None:
        """Slot-parameterized ``end_device_graph_capture``.

        Default: PRIMARY goes to ``end_device_graph_capture``; other slots raise
        :class:`NotSupportedError`.
        Called by: contract/defaults.py, the default ``end_owned_device_graph_capture``.
        """

    @hookspec(firstresult=True)
    def abort_device_graph_capture_in(self, slot: DeviceGraphSlot) -> None:
        """Slot-parameterized ``abort_device_graph_capture``.

        Default: PRIMARY goes to ``abort_device_graph_capture``; other slots raise
        :class:`NotSupportedError`.
        Called by: contract/defaults.py, the default ``abort_owned_device_graph_capture``.
        """

    @hookspec(firstresult=True)
    def replay_device_graph_in(self, slot: DeviceGraphSlot) -> None:
        """Slot-parameterized ``replay_device_graph``.

        Default: PRIMARY goes to ``replay_device_graph``; other slots raise
        :class:`NotSupportedError`.
        Called by: contract/defaults.py, the default ``replay_owned_device_graph``.
        """

    @hookspec(firstresult=True)
    def replay_device_graph_segment_in(self, slot: DeviceGraphSlot, index: int) -> None:
        """Slot-parameterized ``replay_device_graph_segment``.

        Default: PRIMARY goes to ``replay_device_graph_segment``; other slots raise
        :class:`NotSupportedError`.
        Called by: contract/defaults.py, the default ``replay_owned_device_graph_segment``.
        """

    @hookspec(firstresult=True)
    def reset_device_graph_in(self, slot: DeviceGraphSlot) -> bool:
        """Slot-parameterized ``reset_device_graph``.

        Default: PRIMARY goes to ``reset_device_graph``; a never-installed non-PRIMARY slot returns
        False (so unconditional reset sweeps are safe on every provider).
        Called by: contract/defaults.py, the default ``reset_owned_device_graph``.
        """

    @hookspec(firstresult=True)
    def has_device_graph_in(self, slot: DeviceGraphSlot) -> bool:
        """Whether ``slot`` holds a replayable graph.

        Default: True (providers that never lose a graph out-of-band need not track it).
        Called by: contract/defaults.py, the default ``has_owned_device_graph``.
        """

    # -- device graphs: owner-scoped tokens -------------------------------------------------------
    @hookspec(firstresult=True)
    def begin_owned_device_graph_capture(
        self,
        owner: DeviceGraphOwner,
        slot: DeviceGraphSlot,
        continuation: DeviceGraphToken | None,
        kernels: Sequence[Kernel],
    ) -> DeviceGraphToken:
        """Begin capture in ``owner``'s namespace; return the :class:`DeviceGraphToken`.

        ``continuation`` is the token of the generation being extended by a later segment, or
        None for a fresh capture, which mints a new generation.
        Default: the slot hooks hold one graph per slot, so the defaults keep the token of the graph
        each slot holds. A fresh capture resets the graph the slot holds (whoever captured it), calls
        ``begin_device_graph_capture_in(slot, kernels)`` and mints ``owner``'s next generation in
        ``slot`` (1 first); a ``continuation`` must be the token the slot holds (else
        :class:`InvalidArgumentError`) and is returned.
        Called by: session/device_graphs.py, at the capture run (the second run of a feed signature)
        of a session with ``session.graph_capture`` enabled; a session captures only on a provider
        that implements this hook or one of the capture hooks it defaults to.
        """

    @hookspec(firstresult=True)
    def end_owned_device_graph_capture(self, token: DeviceGraphToken) -> None:
        """End the capture identified by ``token``.

        Default: ``end_device_graph_capture_in(token.slot)`` when ``token`` is the capture in progress
        (else :class:`InvalidArgumentError`); the slot then holds ``token``'s graph.
        Called by: session/device_graphs.py, once the captured kernels were recorded.
        """

    @hookspec(firstresult=True)
    def abort_owned_device_graph_capture(self, token: DeviceGraphToken) -> None:
        """Abort the capture identified by ``token``.

        Default: ``abort_device_graph_capture_in(token.slot)`` when ``token`` is the capture in progress;
        otherwise nothing.
        Called by: session/device_graphs.py, when a capture fails (then ``reset_owned_device_graph``).
        """

    @hookspec(firstresult=True)
    def replay_owned_device_graph(self, token: DeviceGraphToken) -> None:
        """Replay exactly the generation ``token`` names; a stale token is an error.

        Default: ``replay_device_graph_in(token.slot)`` when the slot holds ``token``'s graph; a token
        whose graph a later capture replaced is :class:`InvalidArgumentError`, never the other graph.
        Called by: session/device_graphs.py, right after a capture and at every later run with the
        same feed signature.
        """

    @hookspec(firstresult=True)
    def replay_owned_device_graph_segment(self, token: DeviceGraphToken, index: int) -> None:
        """Replay one segment of exactly the generation ``token`` names.

        Default: ``replay_device_graph_segment_in(token.slot, index)`` when the slot holds ``token``'s
        graph; else :class:`InvalidArgumentError`.
        Called by: not by the core (the session replays whole graphs).
        """

    @hookspec(firstresult=True)
    def reset_owned_device_graph(self, token: DeviceGraphToken) -> bool:
        """Reset only the generation ``token`` names; return whether it was installed. A stale
        or foreign token resets nothing and returns False.

        Default: ``reset_device_graph_in(token.slot)`` when the slot holds ``token``'s graph; else False.
        Called by: session/device_graphs.py, after a failed capture and when a signature's graph is
        dropped (least recently used beyond the limit, lost out of band, or the session closes).
        """

    @hookspec(firstresult=True)
    def retire_owned_device_graphs(self, owner: DeviceGraphOwner) -> None:
        """Drop every (empty) graph-lifecycle slot of ``owner`` at its final teardown.

        Default: resets a graph of ``owner`` a slot still holds, and forgets its generations.
        Called by: session/device_graphs.py, when a signature's graph is dropped, after its reset.
        """

    @hookspec(firstresult=True)
    def has_owned_device_graph(self, token: DeviceGraphToken) -> bool:
        """Whether exactly the generation ``token`` names is installed and replayable.

        Default: whether the slot holds ``token``'s graph (no later capture replaced it) and
        ``has_device_graph_in(token.slot)``.
        Called by: session/device_graphs.py, before every replay; False makes the session capture
        that signature afresh.
        """

    # -- deferred device validation ---------------------------------------------------------------
    @hookspec(firstresult=True)
    def register_device_validation_owner(self) -> DeviceValidationRegistration:
        """Register an executor or binding once at setup; return a :class:`DeviceValidationRegistration`.

        Default: a registration of a new :class:`DeviceValidationOwner`.
        Called by: session/executor.py, once per device provider of a session at its creation, when
        ``defers_device_validation`` is True.
        """

    @hookspec(firstresult=True)
    def unregister_device_validation_owner(self, registration: DeviceValidationRegistration) -> None:
        """Retire a registration at teardown.

        Default: nothing to retire.
        Called by: session/executor.py, when the session closes.
        """

    @hookspec(firstresult=True)
    def begin_device_validation(self, registration: DeviceValidationRegistration) -> DeviceValidationToken:
        """Open one top-level validation generation; return its :class:`DeviceValidationToken`.

        Default: generation 0 of the registration's owner.
        Called by: session/executor.py, at the start of every run (eager, captured or replayed by
        session/device_graphs.py) on a provider that defers validation.
        """

    @hookspec(firstresult=True)
    def add_device_validation_recipient(
        self, submission: DeviceValidationToken, recipient: DeviceValidationRegistration
    ) -> DeviceValidationToken:
        """Make output binding ``recipient`` (a registration) an exact recipient of the active
        ``submission``; return the recipient's token for that generation.

        Default: the submission's generation, under the recipient's owner.
        Called by: not by the core (bindings that consume a run's flags after it returns).
        """

    @hookspec(firstresult=True)
    def activate_device_validation(self, submission: DeviceValidationToken) -> None:
        """Seal recipients and make the submission consumable.

        Default: nothing to seal.
        Called by: session/executor.py, once a run's kernels were enqueued (or its graph replayed),
        before its outputs are read.
        """

    @hookspec(firstresult=True)
    def abort_device_validation_submission(self, submission: DeviceValidationToken) -> int:
        """Recover a submission on an error path; return the flags it had raised (0 if none).

        Default: 0.
        Called by: session/executor.py, when a run fails after ``begin_device_validation``; raised
        flags are reported as the failure's root cause.
        """

    @hookspec(firstresult=True)
    def defers_device_validation(self) -> bool:
        """Whether validation is deferred to the next host-visible read.

        Default: False (no validation hook is then called).
        Called by: session/executor.py, once per device provider at session creation.
        """

    @hookspec(firstresult=True)
    def consume_device_validation_error(
        self, registration: DeviceValidationRegistration, token: DeviceValidationToken
    ) -> int:
        """After a host sync, consume the flags of exactly ``token``'s generation (0 = clean).

        Foreign or stale tokens are rejected; concurrent exact consumers see the same result.
        Default: 0.
        Called by: session/executor.py, after a run's outputs were read; non-zero flags raise a
        :class:`DeviceValidationError`.
        """

    # -- compiled contexts ------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def context_source_keys(self) -> Sequence[str]:
        """``EPContext`` source keys this provider accepts.

        Default: none.
        Called by: not by the core (compiled-context caching is not wired into sessions yet).
        """

    @hookspec(firstresult=True)
    def save_context(self) -> EpContext:
        """Return an :class:`EpContext` for the compiled subgraph.

        Default: :class:`NotSupportedError`.
        Called by: not by the core (compiled-context caching is not wired into sessions yet).
        """

    @hookspec(firstresult=True)
    def load_context(self, context: EpContext) -> None:
        """Restore from an :class:`EpContext`, skipping compilation.

        Default: :class:`NotSupportedError`.
        Called by: not by the core (compiled-context caching is not wired into sessions yet).
        """
