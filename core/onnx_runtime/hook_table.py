"""A provider handle's hooks resolved once into plain callables: ``handle.hook.<name>(...)`` without pluggy.

Every hook of the contract is ``firstresult`` and a handle has exactly one implementation of each (the
provider's, else the core's default), so pluggy's manager only forwards each call to one function. Building
that manager (a caller and a specification per hook, a parsed signature per implementation) is most of what a
provider handle costs to create, which every new process pays in its first session. A :class:`HookTable`
instead resolves each hook when it is first called, from what is known of the provider's class (kept per class:
the later handles of a process pay nothing), and calls the implementation as pluggy would: with the arguments
its signature names, the specification's defaults filled in.

Only providers whose hooks are plain functions of their class are read this way; anything else (a hook set on
the instance, a static or class method, a wrapper or ``specname`` option, an argument the specification lacks)
takes pluggy's manager as before, with its validation and messages. The manager is also built on demand
(``ProviderHandle.pm``) for code that registers more plugins on a handle, and from then on every hook is
called through it, so those plugins take part as they always did.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any

from .contract.hookspecs import HOOK_NAMES, ExecutionProviderSpec
from .contract.markers import PROJECT

_IMPL_MARKER = PROJECT + "_impl"
_SPEC_MARKER = PROJECT + "_spec"
_IMPLICIT = frozenset({"self", "cls"})
_PLAIN_OPTIONS = frozenset({"tryfirst", "trylast", "optionalhook"})  # meaningless with one implementation
_HOOKS = frozenset(HOOK_NAMES)

# type -> {hook: (argnames, kwargnames)} of the hooks its functions implement, or None where pluggy must read it
_classes: weakref.WeakKeyDictionary[type, dict[str, tuple] | None] = weakref.WeakKeyDictionary()
_specs: dict[str, tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]]] = {}  # argnames, kwargnames, defaults


def parameters(function) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    """(positional names without a default, names with one) of a plain function defined in a class, its
    implicit first parameter left out, as pluggy reads an implementation; None for anything else."""
    if type(function) is not types.FunctionType or hasattr(function, "__wrapped__"):
        return None
    code, defaults = function.__code__, function.__defaults__ or ()
    names = code.co_varnames[:code.co_argcount]
    if "." not in function.__qualname__.rsplit("<locals>.", 1)[-1] or not names or names[0] not in _IMPLICIT:
        return None
    names = names[1:]
    split = len(names) - len(defaults)
    if split < 0:
        return None
    return names[:split], names[split:]


def _spec(name: str) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, Any]] | None:
    found = _specs.get(name)
    if found is None:
        function = getattr(ExecutionProviderSpec, name)
        read = parameters(function)
        opts = getattr(function, _SPEC_MARKER, None)
        if read is None or not isinstance(opts, dict) or not opts.get("firstresult") or opts.get("historic") \
                or opts.get("warn_on_impl") or opts.get("warn_on_impl_args"):
            return None
        found = _specs[name] = (read[0], read[1], dict(zip(read[1], function.__defaults__ or ())))
    return found


def class_hooks(cls: type) -> dict[str, tuple] | None:
    """The hooks ``cls``'s own functions implement, with their parameters (kept per class); None where the class
    needs pluggy's reading (see the module docstring)."""
    try:
        return _classes[cls]
    except KeyError:
        pass
    found: dict[str, tuple] = {}
    readable = True
    for name in dir(cls):
        if name.startswith("__"):
            continue
        value = next((owner.__dict__[name] for owner in cls.__mro__ if name in owner.__dict__), None)
        if isinstance(value, (staticmethod, classmethod)):
            if getattr(value, _IMPL_MARKER, None) is not None or getattr(value.__func__, _IMPL_MARKER, None) \
                    is not None:
                readable = False
                break
            continue
        opts = getattr(value, _IMPL_MARKER, None) if isinstance(value, types.FunctionType) else None
        if not isinstance(opts, dict):
            continue
        read = parameters(value)
        spec = _spec(name) if name in _HOOKS else None
        if read is None or any(opts.get(key) for key in opts if key not in _PLAIN_OPTIONS) \
                or (name in _HOOKS and (spec is None or not set(read[0]) <= set(spec[0]) | set(spec[1]))):
            readable = False
            break
        found[name] = read
    _classes[cls] = found if readable else None
    return _classes[cls]


def provider_hooks(provider) -> dict[str, tuple] | None:
    """The hooks ``provider`` implements (see class_hooks), or None where pluggy must read it: its class needs
    that, or the instance itself holds a hook implementation."""
    hooks = class_hooks(type(provider))
    if hooks is None:
        return None
    own = getattr(provider, "__dict__", None) or {}
    if any(getattr(value, _IMPL_MARKER, None) is not None for value in own.values()) or own.keys() & hooks.keys():
        return None
    return hooks


def _returns_none(**kwargs):
    return None


def _caller(function: Callable, read: tuple, spec: tuple) -> Callable:
    """``function`` called as pluggy calls a single firstresult implementation: its positional parameters from
    the call's keywords (with the specification's defaults), its defaulted ones where given."""
    argnames, kwargnames = read
    spec_args, _, defaults = spec
    if not defaults and not kwargnames and set(argnames) == set(spec_args):
        return function  # the call's keywords are exactly its parameters

    def call(**kwargs):
        given = {**defaults, **kwargs} if defaults else kwargs
        try:
            args = [given[name] for name in argnames]
        except KeyError as exc:
            from pluggy import HookCallError  # (only for this error)

            raise HookCallError(f"hook call must provide argument {exc.args[0]!r}") from None
        extra = {name: given[name] for name in kwargnames if name in given}
        return function(*args, **extra)

    call.__name__ = getattr(function, "__name__", "hook")
    return call


class HookTable:
    """``handle.hook``: one attribute per hook, resolved at its first call (see the module docstring)."""

    def __init__(self, provider, hooks: dict[str, tuple], defaults) -> None:
        self.__dict__["_table"] = (provider, hooks, defaults)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        provider, hooks, defaults = self.__dict__["_table"]
        manager = self.__dict__.get("_manager")
        if manager is None and name in _HOOKS:
            resolved = self._resolve(name, provider, hooks, defaults)
            if resolved is not None:
                self.__dict__[name] = resolved
                return resolved
        manager = manager if manager is not None else self.__dict__["_make_manager"]()
        caller = getattr(manager.hook, name)
        self.__dict__[name] = caller
        return caller

    @staticmethod
    def _resolve(name: str, provider, hooks: dict[str, tuple], defaults) -> Callable | None:
        spec = _spec(name)
        if spec is None:
            return None
        if name in hooks:
            return _caller(getattr(provider, name), hooks[name], spec)
        function = getattr(defaults, name, None)
        if function is None:
            return _returns_none
        read = parameters(getattr(function, "__func__", None))
        return None if read is None else _caller(function, read, spec)

    def bind_manager(self, make: Callable[[], Any]) -> None:
        """``make()`` builds the pluggy manager when a hook needs it (see ``attach``)."""
        self.__dict__["_make_manager"] = make

    def attach(self, manager) -> None:
        """From now on every hook is called through ``manager`` (plugins registered on it take part)."""
        self.__dict__["_manager"] = manager
        for name in [name for name in self.__dict__ if not name.startswith("_")]:
            self.__dict__[name] = getattr(manager.hook, name)
