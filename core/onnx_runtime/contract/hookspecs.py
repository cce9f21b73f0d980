"""The execution-provider contract, as pluggy hook specifications.

This module is the contract and its documentation: a provider author reads this file and nothing
else. A provider is a class whose methods are marked with ``@onnx_runtime.hookimpl`` and named
after the hooks below. Every hook has a default in :mod:`onnx_runtime.contract.defaults`; a
provider implements a hook simply by defining it, and the default for that hook then steps aside.
So a host provider can be four hooks long (``name``, ``supports_op``, ``get_kernel`` and maybe
``device_type``) and a device provider adds memory, copies and sync.

How hooks are called. Each provider *instance* gets its own ``pluggy.PluginManager`` holding that
instance and the defaults it does not override (see :class:`onnx_runtime.ProviderHandle`), so
``handle.hook.allocate(size=..., alignment=...)`` reaches exactly one implementation. Hooks are
called with keyword arguments; an implementation may accept any subset of the parameters named
here. All hooks are ``firstresult``: the single implementation's return value is the result.
Cross-cutting plugins (tracing, allocation accounting) can wrap any hook with pluggy wrappers.

Hooks are the control plane: placement, kernel creation, planning, copies at boundaries, capture.
The data plane is the kernels ``get_kernel`` returns, which the executor calls directly.

Errors. Raise :class:`onnx_runtime.errors.ProviderError` (or a subclass) with a message that names
the provider, what was wrong and how to fix it.

Providers are found through the ``onnx_runtime.providers`` entry-point group. The entry point
names a module (or object) implementing the discovery hook :meth:`DiscoverySpec.onnx_runtime_providers`.
"""

from __future__ import annotations

from .markers import hookspec


class DiscoverySpec:
    """Process-wide hooks, implemented by the module an entry point names."""

    @hookspec
    def onnx_runtime_providers(self):
        """Return a list of provider classes this plugin contributes.

        Each class must be constructible with no arguments and without touching a device;
        device work belongs in ``initialize``. Example::

            @hookimpl
            def onnx_runtime_providers():
                return [MyExecutionProvider]
        """


class ExecutionProviderSpec:
    """Hooks implemented by one execution-provider instance."""

    # -- identity -----------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def name(self):
        """The provider's name as onnxruntime spells it, e.g. ``"CPUExecutionProvider"``."""

    @hookspec(firstresult=True)
    def short_name(self):
        """A short alias accepted wherever a provider name is, e.g. ``"cpu"``.

        Default: the name lower-cased without ``ExecutionProvider``.
        """

    @hookspec(firstresult=True)
    def device_type(self):
        """The :class:`onnx_runtime.DeviceType` of the memory this provider's kernels use. Default CPU."""

    @hookspec(firstresult=True)
    def device_id(self):
        """The :class:`onnx_runtime.DeviceId` this instance runs on. Default ``DeviceId(device_type(), 0)``."""

    @hookspec(firstresult=True)
    def availability(self):
        """An :class:`Availability`: can this provider run on this machine, and if not, why.

        Called before ``initialize`` and must be cheap and side-effect free (e.g. probe for a
        driver library). The reason is shown by ``onnx-runtime providers`` and in session errors,
        so say what is missing and how to get it. Default: available.
        """

    # -- lifecycle ----------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def initialize(self, options, handle, session_config):
        """Acquire device resources. ``options`` maps namespaced keys to strings.

        The session passes the user's ``provider_options`` for this provider. Unknown keys should
        raise :class:`InvalidArgumentError` naming the key and the accepted ones. ``handle`` is the
        :class:`ProviderHandle` the core dispatches this instance through: keep it to create
        :class:`onnx_runtime.Tensor` outputs on this device from kernels that have no device input.
        ``session_config`` holds session-wide settings as strings under onnxruntime's key names
        (``session.intra_op_num_threads``, ``session.use_deterministic_compute``, and every
        ``SessionOptions.add_session_config_entry``); honour the ones that apply. Default: accept no
        options.
        """

    @hookspec(firstresult=True)
    def shutdown(self):
        """Release device resources. Called once when the last session using the instance closes."""

    # -- capability and kernels ---------------------------------------------------------------
    @hookspec(firstresult=True)
    def supports_op(self, node, opset, shapes, dtypes, layouts):
        """Whether this provider can run ``node`` and at what cost: a :class:`KernelMatch`.

        ``opset`` is the model's opset for the node's domain; ``shapes`` per input a tuple of dims
        (int, or str/None when symbolic/unknown) or None when the rank is unknown; ``dtypes`` per
        input a :class:`DataType` or None; ``layouts`` per input a :class:`TensorLayout`.
        ``node.inputs`` uses "" for omitted optional inputs (its shape and dtype are None).
        An unsupported answer must say what the provider accepts and how to fix it.
        Default: unsupported (the provider implements no operators).
        """

    @hookspec(firstresult=True)
    def get_kernel(self, node, shapes, opset, graph):
        """A kernel for ``node`` specialized to concrete input ``shapes`` (tuples of ints).

        ``graph`` is the :class:`onnx_runtime.ir.Graph` holding the node, for the rare operator
        defined over other nodes of its graph (``Gradient``), and for the values of constant inputs:
        an input named in ``graph.initializers`` holds that value on every run, so a device kernel can
        take its :meth:`host_inputs` from there instead of reading them back from the device.

        The kernel is a callable ``kernel(*inputs) -> tuple of outputs`` (see :class:`Kernel`).
        The session caches kernels per (node, input shapes). Raise :class:`InvalidGraphError` for
        an attribute combination the operator's spec forbids, naming the node and the attribute.
        """

    @hookspec(firstresult=True)
    def host_inputs(self, node, opset):
        """Positions of ``node``'s inputs whose *values* its kernel reads on the host, or None.

        Shape-like inputs (Reshape's shape, Slice's starts/ends/axes/steps, Expand's shape, Tile's
        repeats, a Reduce* axes input, ...) decide output shapes, which are host metadata, so a device
        kernel needs their values on the host when it runs. A kernel takes the value of a constant input
        from ``graph.initializers`` (see :meth:`get_kernel`); any other such input is read back from the
        device at every call, a host synchronization that device-graph capture cannot record.

        Answering a tuple (even an empty one) also states that the kernel reads every other input only
        on the device, so the node's output shapes follow from its input shapes, its attributes and the
        values of these inputs. The session relies on both: a capture region declines a node whose host
        input is not a constant (naming the input), and admits a node whose output shape inference could
        not resolve when its input shapes are resolved and its host inputs are constants.
        Default: None (not declared; nothing is assumed).
        """

    @hookspec(firstresult=True)
    def claim_nodes(self, graph):
        """Names of nodes this provider claims unconditionally, before cost-based placement.

        Default: none.
        """

    @hookspec(firstresult=True)
    def custom_passes(self):
        """Provider-specific graph passes run after the generic optimizer.

        A pass is a callable ``pass_(graph) -> bool`` or ``pass_(graph, owns) -> bool`` rewriting an
        :class:`onnx_runtime.ir.Graph` in place and returning whether it changed anything.
        ``owns(node)`` says whether placement would give the node to this provider (no provider
        listed before it accepts it): fuse only nodes you own, so a fusion never pulls work away from
        a provider the user listed first. Default: none.
        """

    @hookspec(firstresult=True)
    def plan_capture_region(self, node, shape_status):
        """Why ``node`` must stay out of a device-graph capture region, or None to admit it.

        ``shape_status`` is a :class:`CaptureRegionShapeStatus`. The default declines, in this
        order: control-flow and sequence operators, an unresolved output shape, an unresolved
        input shape. An override must still decline whenever either shape is unresolved.
        """

    # -- memory -------------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def allocate(self, size, alignment):
        """A new owned :class:`DeviceBuffer` of ``size`` bytes aligned to ``alignment``.

        Default: aligned host memory when the device is host-accessible; else not supported.
        """

    @hookspec(firstresult=True)
    def allocate_committed(self, size, alignment, committed_ranges):
        """Allocate address space, committing only ``committed_ranges`` (list of (start, stop)).

        Providers that cannot reserve without committing use the default: allocate everything.
        """

    @hookspec(firstresult=True)
    def commit_allocation_range(self, buffer, offset, nbytes):
        """Ensure ``buffer[offset:offset+nbytes]`` is backed by memory. Default: bounds check only."""

    @hookspec(firstresult=True)
    def commit_allocation_ranges(self, ranges):
        """Commit a list of ``(buffer, offset, nbytes)`` as one transaction. Default: one by one."""

    @hookspec(firstresult=True)
    def allocation_committed_bytes(self, buffer):
        """Bytes of ``buffer`` backed by memory. Default: all of it."""

    @hookspec(firstresult=True)
    def deallocate(self, buffer):
        """Free an owned buffer this provider allocated.

        The core calls this at most once per buffer and never for borrowed buffers, so an
        implementation only releases memory. Default: drop the host backing.
        """

    @hookspec(firstresult=True)
    def device_allocation_counts(self):
        """``(allocations, frees)`` made through this provider so far, or None when not counted."""

    # -- copies and ordering ------------------------------------------------------------------
    @hookspec(firstresult=True)
    def copy(self, src, dst, size):
        """Synchronously copy ``size`` bytes from buffer ``src`` to buffer ``dst``.

        Default: host memcpy when both are host-accessible, with bounds checks.
        """

    @hookspec(firstresult=True)
    def copy_async(self, src, dst, size):
        """Enqueue a copy on the transfer stream and return a :class:`Fence` for its completion.

        A consumer of ``dst`` must be ordered after it with ``wait_fence``. Default: copy
        synchronously and return an already-signalled fence.
        """

    @hookspec(firstresult=True)
    def wait_fence(self, fence):
        """Make the compute stream wait for ``fence`` (no host blocking). Default: no-op."""

    @hookspec(firstresult=True)
    def record_compute_fence(self):
        """A :class:`Fence` over all compute enqueued so far (for write-after-read ordering of a
        later transfer into a buffer that compute still reads). Default: signalled."""

    @hookspec(firstresult=True)
    def copy_wait_fence(self, fence):
        """Make the transfer stream wait for a compute ``fence``. Default: no-op."""

    @hookspec(firstresult=True)
    def copy_from_host(self, src, dst):
        """Synchronously upload host bytes ``src`` (bytes-like or C-contiguous array) into ``dst``.

        Default (host-accessible ``dst``): bounds-checked memcpy.
        """

    @hookspec(firstresult=True)
    def copy_from_host_at(self, src, dst, byte_offset):
        """Upload ``src`` into ``dst`` starting at ``byte_offset``; overflow and bounds checked."""

    @hookspec(firstresult=True)
    def copy_to_host(self, src, dst):
        """Synchronously download the first ``len(dst)`` bytes of buffer ``src`` into writable
        host memory ``dst`` (bytearray, memoryview or uint8 array)."""

    @hookspec(firstresult=True)
    def copy_device_to_device(self, src, src_offset, dst, dst_offset, nbytes):
        """Stream-ordered device-to-device copy between two buffers of this provider.

        Default: host memcpy on host-accessible devices; else not supported.
        """

    @hookspec(firstresult=True)
    def sync(self):
        """Block until all work enqueued on this provider has completed. Default: no-op."""

    # -- on-device greedy decoding --------------------------------------------------------------
    @hookspec(firstresult=True)
    def device_argmax_supported(self):
        """Whether ``device_argmax`` is implemented. Default: False."""

    @hookspec(firstresult=True)
    def device_argmax(self, logits, elements, batch, dtype, result, tie_break):
        """Argmax over ``batch`` rows of ``elements`` contiguous ``dtype`` values in ``logits``.

        ``result`` receives two native-endian uint32 words per row at word ``2*row``: the index,
        then the latched device capture-error bitmask. ``tie_break`` is an
        :class:`ArgmaxTieBreak`. Allocation-free; no host synchronization. Default: not supported.
        """

    @hookspec(firstresult=True)
    def device_token_writer(self, result, input_ids, position_ids, attention_mask, scratch,
                            capacity, next_position, mask_len, write_position, step):
        """Fold the token just selected by ``device_argmax`` (``result`` word 0) into the decode
        bindings, device to device: write it as int64 into ``input_ids``; if ``write_position``,
        write ``next_position`` (int64) into ``position_ids``; set ``attention_mask`` (int64) to 1
        at ``next_position`` when ``next_position < mask_len``; store the token in uint32
        ``scratch[step]``; OR ``result`` word 1 into ``scratch[capacity]``. No host sync.
        Default: not supported.
        """

    # -- device graphs: single slot -------------------------------------------------------------
    @hookspec(firstresult=True)
    def begin_device_graph_capture(self, kernels):
        """Begin recording the given already-compiled kernels into a device graph."""

    @hookspec(firstresult=True)
    def end_device_graph_capture(self):
        """End capture and install the executable graph."""

    @hookspec(firstresult=True)
    def abort_device_graph_capture(self):
        """End an in-progress capture without installing it, leaving the stream idle so that a
        later reset succeeds. Default: nothing to abort."""

    @hookspec(firstresult=True)
    def replay_device_graph(self):
        """Replay the installed graph (every segment, in capture order)."""

    @hookspec(firstresult=True)
    def replay_device_graph_segment(self, index):
        """Replay one captured segment by its zero-based capture order."""

    @hookspec(firstresult=True)
    def reset_device_graph(self):
        """Destroy the installed graph; return whether one existed. Default: False."""

    # -- device graphs: slot-routed (defaults route PRIMARY to the single-slot hooks) ------------
    @hookspec(firstresult=True)
    def begin_device_graph_capture_in(self, slot, kernels):
        """Slot-parameterized ``begin_device_graph_capture``; other slots are rejected by default."""

    @hookspec(firstresult=True)
    def end_device_graph_capture_in(self, slot):
        """Slot-parameterized ``end_device_graph_capture``."""

    @hookspec(firstresult=True)
    def abort_device_graph_capture_in(self, slot):
        """Slot-parameterized ``abort_device_graph_capture``."""

    @hookspec(firstresult=True)
    def replay_device_graph_in(self, slot):
        """Slot-parameterized ``replay_device_graph``."""

    @hookspec(firstresult=True)
    def replay_device_graph_segment_in(self, slot, index):
        """Slot-parameterized ``replay_device_graph_segment``."""

    @hookspec(firstresult=True)
    def reset_device_graph_in(self, slot):
        """Slot-parameterized ``reset_device_graph``. By default a never-installed non-PRIMARY
        slot returns False (so unconditional reset sweeps are safe on every provider)."""

    @hookspec(firstresult=True)
    def has_device_graph_in(self, slot):
        """Whether ``slot`` holds a replayable graph. Default True (providers that never lose a
        graph out-of-band need not track it)."""

    # -- device graphs: owner-scoped tokens -------------------------------------------------------
    @hookspec(firstresult=True)
    def begin_owned_device_graph_capture(self, owner, slot, continuation, kernels):
        """Begin capture in ``owner``'s namespace; return the :class:`DeviceGraphToken`.

        ``continuation`` is the token of the generation being extended by a later segment, or
        None for a fresh capture, which mints a new generation.
        """

    @hookspec(firstresult=True)
    def end_owned_device_graph_capture(self, token):
        """End the capture identified by ``token``."""

    @hookspec(firstresult=True)
    def abort_owned_device_graph_capture(self, token):
        """Abort the capture identified by ``token``."""

    @hookspec(firstresult=True)
    def replay_owned_device_graph(self, token):
        """Replay exactly the generation ``token`` names; a stale token is an error."""

    @hookspec(firstresult=True)
    def replay_owned_device_graph_segment(self, token, index):
        """Replay one segment of exactly the generation ``token`` names."""

    @hookspec(firstresult=True)
    def reset_owned_device_graph(self, token):
        """Reset only the generation ``token`` names; return whether it was installed. A stale
        or foreign token resets nothing and returns False."""

    @hookspec(firstresult=True)
    def retire_owned_device_graphs(self, owner):
        """Drop every (empty) graph-lifecycle slot of ``owner`` at its final teardown."""

    @hookspec(firstresult=True)
    def has_owned_device_graph(self, token):
        """Whether exactly the generation ``token`` names is installed and replayable."""

    # -- deferred device validation ---------------------------------------------------------------
    @hookspec(firstresult=True)
    def register_device_validation_owner(self):
        """Register an executor or binding once at setup; return a :class:`DeviceValidationRegistration`."""

    @hookspec(firstresult=True)
    def unregister_device_validation_owner(self, registration):
        """Retire a registration at teardown."""

    @hookspec(firstresult=True)
    def begin_device_validation(self, registration):
        """Open one top-level validation generation; return its :class:`DeviceValidationToken`."""

    @hookspec(firstresult=True)
    def add_device_validation_recipient(self, submission, recipient):
        """Make output binding ``recipient`` (a registration) an exact recipient of the active
        ``submission``; return the recipient's token for that generation."""

    @hookspec(firstresult=True)
    def activate_device_validation(self, submission):
        """Seal recipients and make the submission consumable."""

    @hookspec(firstresult=True)
    def abort_device_validation_submission(self, submission):
        """Recover a submission on an error path; return the flags it had raised (0 if none)."""

    @hookspec(firstresult=True)
    def defers_device_validation(self):
        """Whether validation is deferred to the next host-visible read. Default False."""

    @hookspec(firstresult=True)
    def consume_device_validation_error(self, registration, token):
        """After a host sync, consume the flags of exactly ``token``'s generation (0 = clean).

        Foreign or stale tokens are rejected; concurrent exact consumers see the same result.
        """

    # -- compiled contexts ------------------------------------------------------------------------
    @hookspec(firstresult=True)
    def context_source_keys(self):
        """``EPContext`` source keys this provider accepts. Default: none."""

    @hookspec(firstresult=True)
    def save_context(self):
        """Return an :class:`EpContext` for the compiled subgraph. Default: not supported."""

    @hookspec(firstresult=True)
    def load_context(self, context):
        """Restore from an :class:`EpContext`, skipping compilation. Default: not supported."""


HOOK_NAMES = tuple(
    name for name, value in vars(ExecutionProviderSpec).items()
    if callable(value) and not name.startswith("_")
)
