"""A session's providers: the names and options it asked for, resolved, and a handle made for each that can run
here (as onnxruntime does, a requested provider that cannot is skipped with a warning while another runs)."""

from __future__ import annotations

import warnings

from ..discovery import EXTRAS, registry
from ..errors import InvalidArgumentError, ProviderNotAvailableError
from ..provider_handle import ProviderHandle


def _installed_defaults() -> list[tuple[str, dict]]:
    """The installed providers that can run here (no ``providers`` given), in their priority order."""
    from ..discovery import default_providers
    names = default_providers()
    if not names:
        installed = [e.name for e in registry().entries()]
        if installed:
            reasons = "; ".join(f"{e.name}: {e.availability.reason}" for e in registry().entries())
            raise ProviderNotAvailableError(f"no installed execution provider can run here ({reasons})")
        raise ProviderNotAvailableError(
            "no execution provider is installed; install the CPU provider with "
            f"`{EXTRAS['cpu']}` (or the CUDA one with `{EXTRAS['cuda']}`)"
        )
    return [(n, {}) for n in names]


def resolve_providers(providers, provider_options) -> list[tuple[str, dict]]:
    """(name, options) per requested provider, ``provider_options`` merged in; the installed ones for None."""
    if providers is None:
        return _installed_defaults()
    if isinstance(providers, str):
        providers = [providers]
    resolved = []
    for index, item in enumerate(providers):
        if isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], str):
            name, options = item[0], dict(item[1] or {})
        elif isinstance(item, str):
            name, options = item, {}
        else:
            raise InvalidArgumentError(
                f"providers[{index}] is {item!r}; pass provider names or (name, options) tuples"
            )
        if provider_options is not None:
            if len(provider_options) != len(providers):
                raise InvalidArgumentError(
                    f"provider_options has {len(provider_options)} entries but providers has {len(providers)}; "
                    f"pass one options dict per provider"
                )
            options.update(provider_options[index] or {})
        resolved.append((name, options))
    if not resolved:
        raise InvalidArgumentError("providers is empty; name at least one provider, e.g. ['CPUExecutionProvider']")
    return resolved


FALLBACK_KEY = "session.provider_fallback"  # "1": nothing requested can run -> the CPU provider, as onnxruntime


def create_handles(requested: list[tuple[str, dict]], session_config: dict | None = None) -> list[ProviderHandle]:
    """Handles for the requested providers that can run here. As onnxruntime does, a name that is not installed
    or cannot run here is skipped with a warning when another requested provider runs; when none does, the error
    gives every reason (or, with ``FALLBACK_KEY`` set to "1", onnxruntime's fallback to the CPU provider)."""
    handles: list[ProviderHandle] = []
    unavailable: list[str] = []
    missing: list[ProviderNotAvailableError] = []
    for name, options in requested:
        try:
            entry = registry().require(name)
        except ProviderNotAvailableError as exc:
            missing.append(exc)
            unavailable.append(str(exc))
            continue
        if not entry.availability.available:
            unavailable.append(f"{entry.name}: {entry.availability.reason}")
            continue
        if any(h.name == entry.name for h in handles):
            continue
        handle = entry.create()
        handle.initialize(options, session_config)
        handles.append(handle)
    if not handles:
        cpu = registry().find("CPUExecutionProvider")
        if (session_config or {}).get(FALLBACK_KEY) == "1" and cpu is not None and cpu.availability.available:
            warnings.warn("onnx-runtime: none of the requested providers can run here (" + "; ".join(unavailable)
                          + "); falling back to CPUExecutionProvider", RuntimeWarning, stacklevel=4)
            return create_handles([("CPUExecutionProvider", {})], session_config)
        if len(missing) == len(requested) == 1:
            raise missing[0]
        raise ProviderNotAvailableError(
            "none of the requested execution providers can run here: " + "; ".join(unavailable)
            + f" (session config entry {FALLBACK_KEY!r} = '1' falls back to the CPU provider as onnxruntime does)"
        )
    for reason in unavailable:
        warnings.warn(f"onnx-runtime: skipping unavailable provider {reason}", RuntimeWarning, stacklevel=4)
    return handles
