"""Greedy text generation with a decoder exported with its KV cache (``onnx-runtime generate``).

The loop runs on :class:`DeviceIoBinding` buffers, so its state stays where the provider keeps it:

- one binding per past key/value input, aliased by its present output, at a capacity of prompt + new
  tokens: each step appends in place at the same address;
- ``input_ids``, ``position_ids`` and ``attention_mask`` bindings, rewritten on the device by the
  token writer (the chosen token, its position, the mask bit);
- the logits binding, whose last row ``device_argmax`` reduces on the device into a result binding.

Per step the host reads nothing but the 4-byte token it streams (or, without streaming, the first
token only, for the time to first token; the rest are drained at the end). On the CPU provider
"device" memory is host memory and the contract's defaults run argmax and the token writer in numpy.

With device-graph capture on (``session.graph_capture``), the KV cache is shown to the model at its
capacity instead, so every decode step has one feed signature and is replayed from one graph. The
exports append the step's keys and values by ``Concat(past, new)``, so ``present`` holds capacity + new
rows: the valid rows of ``past`` are those the mask marks, the new ones land at index ``capacity`` of
``present`` (mask bit ``capacity`` set), and after the run they are copied on the device to their place
``past[length]`` (one pitched copy per cache, the provider's ``device_copy_rows``), whose mask bit is then set by a
device copy as well. The rows past the valid length
are zeros and masked out, so attention over them adds exact zeros.

The model must take ``input_ids`` and ``attention_mask`` (int64, [batch, sequence]), optionally
``position_ids``, and ``past*`` inputs [batch, heads, past_sequence, head_dim] each answered by a
``present*`` output, and give ``logits`` [batch, sequence, vocabulary] (the layout of transformers'
decoder exports with past, TorchScript or dynamo). Text goes through the ``tokenizers`` library, from
the ``tokenizer.json`` in the model's folder.
"""

from __future__ import annotations

import copy
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from .dtypes import DataType
from .errors import InvalidArgumentError, InvalidGraphError
from .session.device_io_binding import DeviceBindingSpec, DeviceIoBinding, device_copy
from .session.device_step import StepEpilogue
from .session.inference_session import GRAPH_CAPTURE_KEY, InferenceSession
from .session.options import SessionOptions

# Bytes of one host KV cache at capacity from which it is appended in place (see _Bindings._bind_cache): every
# size, since the decode attention reads the cache where it lies (tests raise it to compare with the copying loop).
IN_PLACE_BYTES = 0
_FLOAT32 = np.dtype(np.float32)


@dataclass
class GenerationResult:
    """Token ids generated after the prompt, and how fast: ``time_to_first_token`` (seconds from the start
    of the prefill until the first token is on the host) and ``tokens_per_second`` (the steps after it)."""

    prompt_tokens: list[int]
    tokens: list[int]
    time_to_first_token: float
    seconds: float
    text: str | None = None
    steps: int = field(default=0)

    @property
    def tokens_per_second(self) -> float:
        decode = self.seconds - self.time_to_first_token
        return (len(self.tokens) - 1) / decode if len(self.tokens) > 1 and decode > 0 else 0.0


@dataclass(frozen=True)
class _Layout:
    """The decoder's names and cache geometry, read from the model's inputs and outputs."""

    positions: bool
    caches: tuple[tuple[str, str, DataType, int, int], ...]  # (past input, present output, dtype, heads, head dim)
    logits_dtype: DataType
    vocabulary: int


def _layout(session: InferenceSession) -> _Layout:
    inputs = {arg.name: arg for arg in session.get_inputs()}
    outputs = {arg.name: arg for arg in session.get_outputs()}
    for name in ("input_ids", "attention_mask"):
        if name not in inputs or inputs[name].type != "tensor(int64)":
            raise InvalidGraphError(
                f"generate needs a decoder exported with past: an int64 input {name!r} (the model's inputs are "
                f"{list(inputs)})"
            )
    if "logits" not in outputs or len(outputs["logits"].shape) != 3 or not isinstance(outputs["logits"].shape[2], int):
        raise InvalidGraphError("generate needs an output 'logits' of shape [batch, sequence, vocabulary]")
    caches = []
    for name, arg in inputs.items():
        if "past" not in name:
            continue
        present = next((candidate for candidate in (name.replace("past_key_values", "present"),
                                                    name.replace("past", "present")) if candidate in outputs), None)
        shape = arg.shape
        if present is None or len(shape) != 4 or not isinstance(shape[1], int) or not isinstance(shape[3], int):
            raise InvalidGraphError(
                f"past input {name!r} needs a matching present output and the shape [batch, heads, past_sequence, "
                f"head_dim] with heads and head_dim fixed; it is {shape} (outputs: {list(outputs)})"
            )
        caches.append((name, present, DataType.parse(arg.type), shape[1], shape[3]))
    if not caches:
        raise InvalidGraphError("generate needs a decoder exported with past (past_key_values.* inputs); none found")
    return _Layout("position_ids" in inputs, tuple(caches), DataType.parse(outputs["logits"].type),
                   outputs["logits"].shape[2])


class Generator:
    """Greedy decoding for one decoder session (see the module docstring)."""

    def __init__(self, model, providers=None, sess_options=None):
        self.session = model if isinstance(model, InferenceSession) else InferenceSession(
            model, sess_options, providers=providers)
        self.layout = _layout(self.session)
        config = self.session.get_session_options().config()
        self.at_capacity = config.get(GRAPH_CAPTURE_KEY) == "1"  # see the module docstring
        # The last generation's state in host memory, kept for the next generation that fits in it: binding ten
        # or more buffers through the provider's hooks costs more than a short prompt's prefill, and the same
        # bindings keep the checks their first runs passed (device_binding_run's layouts).
        self._kept: _Bindings | None = None
        self._keeping = threading.Lock()

    def generate(self, prompt: Sequence[int], max_new_tokens: int, on_token: Callable[[int], None] | None = None,
                 eos_token_id: int | None = None, read_every: int = 1) -> GenerationResult:
        """Greedy tokens after ``prompt``; ``on_token`` receives each as it is chosen. Stops after
        ``max_new_tokens`` or at ``eos_token_id``. Either reads the chosen tokens from the device every
        ``read_every`` steps (one read, and one host synchronization, per ``read_every`` tokens; tokens chosen
        after the end-of-sequence token in the same read are dropped); with neither, only the first token is
        read before the end."""
        if isinstance(read_every, bool) or not isinstance(read_every, int) or read_every < 1:
            raise InvalidArgumentError(f"read_every is a number of steps, at least 1; got {read_every!r}")
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise InvalidArgumentError("the prompt has no tokens; pass at least one token id")
        if max_new_tokens < 1:
            raise InvalidArgumentError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        vocabulary = self.layout.vocabulary
        if min(prompt) < 0 or max(prompt) >= vocabulary:
            raise InvalidArgumentError(
                f"prompt token ids must lie in [0, {vocabulary}); got {min(prompt)}..{max(prompt)}")
        state = self._state(len(prompt), max_new_tokens)
        try:
            result = state.loop(prompt, max_new_tokens, on_token, eos_token_id, read_every)
        except BaseException:
            state.close()  # (a state a failed step left behind is not reused)
            raise
        self._keep(state)
        return result

    def _state(self, prompt: int, new: int) -> _Bindings:
        """The kept state if this generation fits in it, else a new one (at least as large as the kept one, which
        is released: a caller alternating lengths settles on the largest)."""
        with self._keeping:
            kept, self._kept = self._kept, None
        sizes = (prompt, prompt + new, new)
        if kept is not None:
            if kept.fits(*sizes):
                kept.reset()
                return kept
            sizes = (max(prompt, kept.prompt_rows), max(prompt + new, kept.capacity), max(new, kept.new_rows))
            kept.close()
        bindings = _CapacityBindings if self.at_capacity else _Bindings
        return bindings(self.session, self.layout, *sizes)

    def _keep(self, state: _Bindings) -> None:
        if not state.reusable:
            state.close()
            return
        with self._keeping:
            displaced, self._kept = self._kept, state  # (another thread's generation may have kept one meanwhile)
        if displaced is not None:
            displaced.close()

    def close(self) -> None:
        """Release the kept generation state (the session releases it too, when it closes)."""
        with self._keeping:
            kept, self._kept = self._kept, None
        if kept is not None:
            kept.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class _Bindings:
    """The decode state of a generation, on the session's device: made for ``prompt`` tokens and ``capacity`` rows
    of which ``new`` are generated, and reused by a later generation that fits (host memory only; see
    :meth:`Generator._state`), else released when its generation ends."""

    HOST_LOGITS = True  # whether a host loop takes the logits as a run output (see __init__)

    def __init__(self, session: InferenceSession, layout: _Layout, prompt: int, capacity: int, new: int):
        self.session, self.layout = session, layout
        self.prompt_rows, self.capacity, self.new_rows = prompt, capacity, new
        self.home = logits_provider(session)  # the state lives where the logits are made
        self.owned: list[DeviceIoBinding] = []
        bind = self._bind
        self.presents: list[DeviceIoBinding] = []
        self._bind_cache(layout, prompt)
        self.ids = bind(DeviceBindingSpec.input("input_ids", np.int64, (1, prompt), expose_logical_input_shape=True))
        self.positions = bind(DeviceBindingSpec.input("position_ids", np.int64, (1, prompt),
                                                      expose_logical_input_shape=True)) if layout.positions else None
        self.logits = bind(DeviceBindingSpec.output("logits", layout.logits_dtype.numpy,
                                                    (1, prompt, layout.vocabulary)))
        self.result = bind(DeviceBindingSpec.scratch("argmax", np.uint32, (2,)))
        self.tokens = bind(DeviceBindingSpec.scratch("tokens", np.uint32, (new + 1,)))
        # On host memory (the CPU provider) the step's argmax and token writes are numpy over the bindings' own
        # arrays: what the contract's default hooks do, without their dispatch and checks on every step.
        self.host = _host_arrays(self.logits, self.ids, self.positions, self.mask, self.tokens)
        # On the host the logits are the run's output as the kernel made them, not copied into their binding
        # first (a copy of the whole vocabulary per step).
        self.wanted = ["logits"] if self.host is not None and self.HOST_LOGITS else []
        self.prepared = None  # the session's prepared run of this state's bindings (_host_run)

    def _bind_cache(self, layout: _Layout, prompt: int) -> None:
        """The KV cache (each past aliased by its present: appended in place) and the mask, growing by steps."""
        # Reserved at capacity, committed as the rows arrive (from the start: the valid rows are compact there),
        # on providers that reserve address space; the others commit it all at once.
        self.committed_rows = prompt
        # In host memory the cache is laid out at its capacity instead (every row at a fixed address, committed
        # at once), so each step appends its rows in place rather than copying the cache twice (kv_append.py),
        # and the attention reads the valid rows there (kv_append.contiguous_rows) instead of a third copy.
        in_place = self.session.provider_handle(self.home).is_host_accessible and min(
            heads * self.capacity * dim * dtype.numpy.itemsize for _past, _present, dtype, heads, dim in layout.caches
        ) >= IN_PLACE_BYTES
        if in_place:
            self.committed_rows = self.capacity
        self.caches = [self._bind(DeviceBindingSpec.input(
            past, dtype, (1, heads, self.capacity, dim), (1, heads, 0, dim), output_name=present,
            expose_logical_input_shape=True, fixed_physical_strides=in_place,
            committed_ranges=None if in_place else [(0, heads * prompt * dim * dtype.numpy.itemsize)]))
            for past, present, dtype, heads, dim in layout.caches]
        self.mask = self._bind(DeviceBindingSpec.input("attention_mask", np.int64, (1, self.capacity), (1, prompt),
                                                       expose_logical_input_shape=True))
        self.mask_len = self.capacity  # where the token writer may set the chosen token's mask bit

    def _bind(self, spec: DeviceBindingSpec) -> DeviceIoBinding:
        binding = self.session.device_io_binding(spec, provider=self.home)
        self.owned.append(binding)
        return binding

    @property
    def reusable(self) -> bool:
        """Whether a later generation may run on this state: host memory (a device state keeps its captured
        graphs and committed ranges per generation, as before)."""
        return type(self) is _Bindings and self.host is not None

    def fits(self, prompt: int, capacity: int, new: int) -> bool:
        return prompt <= self.prompt_rows and capacity <= self.capacity and new <= self.new_rows

    def reset(self) -> None:
        """Empty the KV cache for the next generation (``loop`` writes the rest of the state)."""
        for cache in self.caches:
            _one, heads, _rows, dim = cache.physical_shape
            cache.set_logical_shape((1, heads, 0, dim))

    def close(self) -> None:
        for binding in self.owned:
            binding.close()

    def _choose(self, step: int, position: int, new: int, values: Sequence = ()) -> None:
        """Argmax of the last logits row and the token folded into the bindings: on the device where the provider
        can, else through the host (the row down, the token up); ``values``: the run's host outputs."""
        vocabulary = self.layout.vocabulary
        if self.host is not None:
            logits = self.host[0]
            assert logits is not None
            if values:
                row = values[0][0, -1]
            else:
                offset = (self.logits.logical_shape[1] - 1) * vocabulary
                row = logits[offset: offset + vocabulary]
            self._choose_on_host(step, position, row)
            return
        offset = (self.logits.logical_shape[1] - 1) * vocabulary
        if self.logits.device_argmax_supported():
            self.logits.device_argmax(vocabulary, 1, self.result, element_offset=offset)
            self.result.device_token_writer(self.ids, self.positions, self.mask, self.tokens, capacity=new,
                                            next_position=position, mask_len=self.mask_len, step=step)
            return
        itemsize = self.layout.logits_dtype.numpy.itemsize
        row = np.frombuffer(self.logits.read_bytes_range(offset * itemsize, vocabulary * itemsize),
                            self.layout.logits_dtype.numpy)
        token = int(np.argmax(row.astype(np.float32)))
        self.ids.write_bytes(0, np.array([token], np.int64))
        if self.positions is not None:
            self.positions.write_bytes(0, np.array([position], np.int64))
        if position < self.mask_len:
            self.mask.write_bytes(8 * position, np.array([1], np.int64))
        self.tokens.write_bytes(4 * step, np.array([token], np.uint32))

    def _write(self, binding: DeviceIoBinding, array: np.ndarray) -> None:
        """``binding.write_logical(array)``; on a host state, straight into its array (no transfer to count, and
        none of the provider hooks' dispatch a short generation would pay for each of its four writes)."""
        if self.host is None:
            binding.write_logical(array)
            return
        host = binding.host_array()
        assert host is not None
        host[: array.size] = array.reshape(-1)
        binding.set_logical_shape(array.shape)

    def _tokens(self, start: int, stop: int) -> np.ndarray:
        """The chosen tokens ``start:stop`` (the flags word at index ``new``), read from the device or host state."""
        if self.host is not None:
            tokens = self.host[4]
            assert tokens is not None
            return tokens[start:stop].copy()
        return np.frombuffer(self.tokens.read_bytes_range(4 * start, 4 * (stop - start)), np.uint32)

    def _choose_on_host(self, step: int, position: int, row: np.ndarray) -> None:
        """The token of the logits ``row`` written into the host bindings' arrays (ids, position, mask bit, tokens)."""
        _logits, ids, positions, mask, tokens = self.host  # type: ignore[misc]
        assert ids is not None and mask is not None and tokens is not None
        # numpy's argmax takes the first maximum and ranks NaN above every number, as device_argmax does.
        token = int((row if row.dtype is _FLOAT32 else row.astype(np.float32)).argmax())
        ids[0] = token
        if positions is not None:
            positions[0] = position
        if position < self.mask_len:
            mask[position] = 1
        tokens[step] = token

    def _start(self, length: int) -> list[DeviceIoBinding]:
        """Write the prompt's state; the bindings of a run."""
        mask = np.zeros((1, self.capacity), np.int64)
        mask[0, :length] = 1
        self._write(self.mask, mask)
        self.mask.set_logical_shape((1, length))
        logits = [] if self.wanted else [self.logits]
        return [*self.caches, self.ids, self.mask, *logits] + ([self.positions] if self.positions else [])

    def _ran(self, step: int, length: int) -> None:
        """After step ``step``'s run: nothing to do here (the KV cache grew in place)."""

    def _grow(self, rows: int) -> None:
        """Commit the KV cache for ``rows`` rows before a run writes them, doubling the committed rows (capped at
        the capacity) so a generation commits a logarithmic number of times."""
        if rows <= self.committed_rows:
            return
        self.committed_rows = min(self.capacity, max(rows, 2 * self.committed_rows))
        for cache, (_past, _present, dtype, heads, dim) in zip(self.caches, self.layout.caches):
            cache.commit_range(0, heads * self.committed_rows * dim * dtype.numpy.itemsize)

    def _next_mask_shape(self, step: int, length: int) -> tuple[int, int]:
        return (1, length + step + 1)

    def _epilogue(self, step: int, length: int, new: int) -> StepEpilogue | None:
        """What follows step ``step``'s run on the device within its captured graph; None: ``_ran`` and
        ``_choose`` follow it instead."""
        return None

    def _read(self, tokens: list[int], steps: int, on_token, eos_token_id) -> bool:
        """Read the tokens chosen since the last read (one download) onto ``tokens``, streaming each; whether the
        end-of-sequence token was among them (the ones after it are dropped)."""
        chosen = self._tokens(len(tokens), steps)
        for token in map(int, chosen):
            tokens.append(token)
            if on_token is not None:
                on_token(token)
            if token == eos_token_id:
                return True
        return False

    def _step(self, bindings: list[DeviceIoBinding], step: int, length: int, new: int) -> None:
        """One step's run and choice through ``run_with_device_bindings`` (see ``_host_run`` for the host's)."""
        epilogue = self._epilogue(step, length, new)
        values = self.session.run_with_device_bindings(bindings, output_names=self.wanted,
                                                       single_token_step=step > 0, epilogue=epilogue)
        if epilogue is None:
            self._ran(step, length)
            self._choose(step, length + step, new, values)

    def _advance(self, step: int, length: int, every: bool) -> None:
        """The next step's shapes: one token (set once on the host, where nothing else sets them) and the mask."""
        if step == 0 or every:
            self.ids.set_logical_shape((1, 1))
            if self.positions is not None:
                self.positions.set_logical_shape((1, 1))
        self.mask.set_logical_shape(self._next_mask_shape(step, length))

    def _host_run(self, bindings: list[DeviceIoBinding]):
        """The session's prepared run of these bindings where the whole state is in host memory and a step is the run
        then the host's argmax (made once per state: a reused state binds the same buffers); else None."""
        if type(self) is not _Bindings or self.host is None or self.wanted != ["logits"]:
            return None
        if self.prepared is None:
            self.prepared = self.session.prepare_device_binding_run(bindings, output_names=self.wanted)
        return self.prepared

    def _host_steps(self, run, length: int, new: int, tokens: list[int], read_each: bool, read_every: int, on_token,
                    eos_token_id, start: float) -> tuple[int, float]:
        """``loop``'s steps on a host state through its prepared ``run``: each step the run, the host's argmax, and
        the mask grown by one row (within the capacity, which holds prompt + new rows, so set unchecked); the number
        of steps run and the time to the first token."""
        choose, grow_mask = self._choose_on_host, self.mask.set_appended_shape
        first = 0.0
        steps = 0
        for step in range(new):
            rows = length + step + 1 if step else length
            if rows > self.committed_rows:
                self._grow(rows)
            choose(step, length + step, run(step > 0)[0][0, -1])
            steps += 1
            if step == 0 or read_each:  # (else nothing is due: _read_due's own first test, without its call)
                ended, first = self._read_due(step, steps, new, read_each, read_every, tokens, on_token,
                                              eos_token_id, start, first)
                if ended:
                    break
            if step == 0:  # one token from now on (set once: nothing else sets the host's shapes)
                self.ids.set_logical_shape((1, 1))
                if self.positions is not None:
                    self.positions.set_logical_shape((1, 1))
            grow_mask((1, length + step + 1))
        return steps, first

    def _read_due(self, step: int, steps: int, new: int, read_each: bool, read_every: int, tokens: list, on_token,
                  eos_token_id, start: float, first: float) -> tuple[bool, float]:
        """Read the tokens where due (the first step, every ``read_every`` steps and the last when a caller streams
        or stops at an end token); (whether generation ended, the time to the first token)."""
        if step == 0 or (read_each and (steps % read_every == 0 or step == new - 1)):
            ended = self._read(tokens, steps, on_token, eos_token_id)
            return ended, time.perf_counter() - start if step == 0 else first
        return False, first

    def loop(self, prompt: list[int], new: int, on_token, eos_token_id, read_every: int = 1) -> GenerationResult:
        length = len(prompt)
        self._write(self.ids, np.array([prompt], np.int64))
        if self.positions is not None:
            self._write(self.positions, np.arange(length, dtype=np.int64).reshape(1, length))
        bindings = self._start(length)
        self._write(self.tokens, np.zeros(new + 1, np.uint32))
        read_each = on_token is not None or eos_token_id is not None
        tokens: list[int] = []
        start = time.perf_counter()
        first = 0.0
        steps = 0
        prepared = self._host_run(bindings)
        if prepared is not None:
            # A host loop enters the session's per-run scopes once for all its steps, not at each step.
            with prepared.held() as run:
                steps, first = self._host_steps(run, length, new, tokens, read_each, read_every, on_token,
                                                eos_token_id, start)
        for step in range(new if prepared is None else 0):
            self._grow(length + step + 1 if step else length)
            self._step(bindings, step, length, new)
            steps += 1
            ended, first = self._read_due(step, steps, new, read_each, read_every, tokens, on_token, eos_token_id,
                                          start, first)
            if ended:
                break
            self._advance(step, length, True)
        drained = self._tokens(0, new + 1)
        if not read_each:
            tokens = [int(t) for t in drained[:steps]]
        if drained[new]:
            raise InvalidArgumentError(
                f"the device raised validation flags 0x{int(drained[new]):x} during generation: a kernel met invalid "
                f"data (e.g. a token id out of the embedding's range)"
            )
        return GenerationResult(prompt, tokens, first, time.perf_counter() - start, steps=steps)


class _CapacityBindings(_Bindings):
    """The decode state with the KV cache shown at its capacity (see the module docstring): one feed signature
    for every decode step, so the step is captured once and replayed."""

    HOST_LOGITS = False

    def _bind_cache(self, layout: _Layout, prompt: int) -> None:
        capacity, bind = self.capacity, self._bind
        self.caches = [bind(DeviceBindingSpec.input(past, dtype, (1, heads, capacity, dim)))
                       for past, _present, dtype, heads, dim in layout.caches]
        self.presents = [bind(DeviceBindingSpec.output(present, dtype, (1, heads, capacity + prompt, dim)))
                         for _past, present, dtype, heads, dim in layout.caches]
        self.mask = bind(DeviceBindingSpec.input("attention_mask", np.int64, (1, capacity + prompt),
                                                 expose_logical_input_shape=True))
        self.mask_len = 0  # the mask bit of a new row is set once the row is in place (_ran)
        # Step and position on the device (int64 words), read and advanced by the captured step's epilogue.
        hook = self.session.provider_handle(self.home)
        self.counter = self._bind(DeviceBindingSpec.scratch("counter", np.int64, (2,))) if all(
            hook.implements(name) for name in ("device_token_writer_at", "device_copy_rows_at")) else None

    def _start(self, length: int) -> list[DeviceIoBinding]:
        for binding in self.caches:  # rows past the valid length are read (masked): zeros, never garbage
            binding.write_logical(np.zeros(binding.physical_shape, binding.dtype.numpy))
        if self.counter is not None:
            self.counter.write_logical(np.array([0, length], np.int64))
        mask = np.zeros((1, self.capacity + length), np.int64)
        mask[0, self.capacity:] = 1  # the prompt's rows, appended after the (empty) cache
        self.mask.write_logical(mask)
        return [*self.caches, *self.presents, self.ids, self.mask, self.logits] + (
            [self.positions] if self.positions else [])

    def _ran(self, step: int, length: int) -> None:
        """Copy the rows the run appended (index ``capacity`` of each present) to their place in the cache, and set
        their mask bits, on the device."""
        rows, start = (length, 0) if step == 0 else (1, length + step - 1)
        capacity = self.capacity
        for past, present in zip(self.caches, self.presents):
            itemsize = past.dtype.numpy.itemsize
            _one, heads, _capacity, dim = past.physical_shape
            row = dim * itemsize
            # Each head's new rows, at the two buffers' head strides: one pitched copy per cache.
            past.allocator.hook.device_copy_rows(
                src=present.buffer, src_offset=capacity * row, src_pitch=(capacity + rows) * row, dst=past.buffer,
                dst_offset=start * row, dst_pitch=capacity * row, row_bytes=rows * row, rows=heads)
        # The mask bits of the moved rows from those of the appended rows (ones), device to device.
        device_copy(self.mask.allocator, self.mask.buffer, 8 * capacity, self.mask.buffer, 8 * start, 8 * rows)

    def _next_mask_shape(self, step: int, length: int) -> tuple[int, int]:
        return (1, self.capacity + 1)

    def _choose(self, step: int, position: int, new: int, values: Sequence = ()) -> None:
        if self.counter is None or self.host is not None or not self.logits.device_argmax_supported():
            super()._choose(step, position, new, values)
            return
        self.logits.device_argmax(self.layout.vocabulary, 1, self.result,
                                  element_offset=(self.logits.logical_shape[1] - 1) * self.layout.vocabulary)
        self.result.device_token_writer_at(self.ids, self.positions, self.mask, self.tokens, new, 0, self.counter)

    def _epilogue(self, step: int, length: int, new: int) -> StepEpilogue | None:
        """A decode step's ``_ran`` and ``_choose`` with the step and position read from the device counter, so
        the step's graph replays them as they are: the appended rows go to row ``position - 1`` (the token this
        step ran), the mask bit likewise, then argmax and the counter's token writer."""
        counter = self.counter
        if step == 0 or counter is None or self.host is not None or not self.logits.device_argmax_supported():
            return None
        capacity, vocabulary = self.capacity, self.layout.vocabulary
        moves = []
        for past, present in zip(self.caches, self.presents):
            _one, heads, _capacity, dim = past.physical_shape
            row = dim * past.dtype.numpy.itemsize
            moves.append(dict(src=present.buffer, src_offset=capacity * row, src_pitch=(capacity + 1) * row,
                              dst=past.buffer, dst_pitch=capacity * row, row_bytes=row, rows=heads, dst_unit=row))
        moves.append(dict(src=self.mask.buffer, src_offset=8 * capacity, src_pitch=8, dst=self.mask.buffer,
                          dst_pitch=8, row_bytes=8, rows=1, dst_unit=8))
        hook = self.mask.allocator.hook

        def launch() -> None:
            for move in moves:
                hook.device_copy_rows_at(**move, counter=counter.buffer, word=1, bias=-1, limit=capacity)
            self.logits.device_argmax(vocabulary, 1, self.result)
            self.result.device_token_writer_at(self.ids, self.positions, self.mask, self.tokens, new, 0, counter)

        bindings = (*self.caches, *self.presents, self.mask, self.logits, self.result, self.ids, self.tokens, counter,
                    *((self.positions,) if self.positions is not None else ()))
        key = ("decode", capacity, new, tuple(binding.buffer.ptr for binding in bindings))
        return StepEpilogue(launch, key, bindings)

    def _grow(self, rows: int) -> None:
        """Nothing: the cache is read at its capacity, so all of it is committed."""


def _host_arrays(*bindings: DeviceIoBinding | None) -> tuple[np.ndarray | None, ...] | None:
    """The bindings' host arrays (None for an absent binding), or None unless every binding is in host memory."""
    arrays = tuple(None if binding is None else binding.host_array() for binding in bindings)
    present = [array for binding, array in zip(bindings, arrays) if binding is not None]
    return arrays if all(array is not None for array in present) else None


def logits_provider(session: InferenceSession) -> str:
    """The provider running the node that makes the logits: where the decode state is kept."""
    producer = next(node.name for node in session.model.graph.nodes if "logits" in node.outputs)
    return next(placed.provider for placed in session.placement() if placed.node == producer)


def load_tokenizer(model_path: str):
    """The ``tokenizers`` Tokenizer from ``tokenizer.json`` beside the model."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise InvalidArgumentError("generate needs the tokenizers library for text; pip install tokenizers") from None
    path = os.path.join(os.path.dirname(os.path.abspath(model_path)), "tokenizer.json")
    if not os.path.exists(path):
        raise InvalidArgumentError(
            f"no tokenizer.json beside {model_path!r}; save the model's tokenizer there "
            f"(transformers: tokenizer.save_pretrained(folder)), or pass --prompt-ids"
        )
    return Tokenizer.from_file(path)


def generate_text(model_path: str, prompt: str, max_new_tokens: int = 32, providers=None,
                  on_text: Callable[[str], None] | None = None,
                  sess_options: SessionOptions | None = None) -> GenerationResult:
    """Tokenize ``prompt`` with the model's tokenizer, generate greedily, and decode; ``on_text`` receives the
    text as it grows (each new piece)."""
    tokenizer = load_tokenizer(model_path)
    prompt_ids = tokenizer.encode(prompt).ids
    generator = Generator(model_path, providers, device_capture_options(providers, sess_options))
    eos = next((tokenizer.token_to_id(t) for t in ("</s>", "<|endoftext|>", "<eos>") if tokenizer.token_to_id(t)
                is not None), None)
    shown = ""
    chosen: list[int] = []

    def stream(token: int) -> None:
        nonlocal shown
        chosen.append(token)
        text = tokenizer.decode(chosen)
        if on_text is not None and text.startswith(shown):
            on_text(text[len(shown):])
            shown = text

    result = generator.generate(prompt_ids, max_new_tokens, stream, eos)
    result.text = tokenizer.decode(result.tokens)
    return result


def device_capture_options(providers, base: SessionOptions | None = None) -> SessionOptions | None:
    """Session options capturing device graphs when a device provider is asked for (the decode step is then
    replayed, see the module docstring); None on the CPU, where a cache shown at capacity only costs work."""
    names = [p if isinstance(p, str) else p[0] for p in providers or ()]
    if not any(name not in ("CPUExecutionProvider", "cpu") for name in names):
        return base
    if base is not None and base.config().get("session.weight_residency_budget"):
        return base  # paged weights move between steps: a captured graph would replay stale addresses
    options = copy.deepcopy(base) if base is not None else SessionOptions()  # (the caller's stay as they are)
    options.add_session_config_entry(GRAPH_CAPTURE_KEY, "1")
    return options


def run_cli(args, sess_options: SessionOptions | None = None) -> int:
    """``onnx-runtime generate``: stream the generated text (or token ids), then the timings."""
    import sys

    providers = [p.strip() for p in args.providers.split(",") if p.strip()] if args.providers else None
    if (args.prompt is None) == (args.prompt_ids is None):
        raise InvalidArgumentError("pass exactly one of --prompt TEXT and --prompt-ids 1,2,3")

    def show(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if args.prompt is not None:
        show(args.prompt)
        result = generate_text(args.model, args.prompt, args.max_new_tokens, providers, show, sess_options)
    else:
        try:
            ids = [int(t) for t in args.prompt_ids.split(",") if t.strip()]
        except ValueError:
            raise InvalidArgumentError(
                f"--prompt-ids takes comma-separated integers, got {args.prompt_ids!r}") from None
        generator = Generator(args.model, providers, device_capture_options(providers, sess_options))
        result = generator.generate(ids, args.max_new_tokens, lambda t: show(f" {t}"))
    print()
    print(f"{len(result.tokens)} tokens; time to first token {result.time_to_first_token * 1e3:.1f} ms; "
          f"{result.tokens_per_second:.1f} tokens/s after it")
    return 0
