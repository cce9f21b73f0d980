"""The markers of the provider contract: ``hookspec`` (core only) and ``hookimpl`` (providers).

They mark a function exactly as pluggy's ``HookspecMarker`` / ``HookimplMarker`` do (the options, under the
``onnx_runtime_spec`` / ``onnx_runtime_impl`` attribute, which pluggy's manager reads), without importing pluggy:
a session whose handles call their hooks directly (hook_table.py) never builds a manager, so a process need not
load pluggy to define the contract or a provider.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar, overload

PROJECT = "onnx_runtime"

F = TypeVar("F", bound=Callable[..., object])


class HookspecMarker:
    """``@hookspec`` or ``@hookspec(firstresult=True, ...)``, with pluggy's options and meaning."""

    __slots__ = ("project_name",)

    def __init__(self, project_name: str) -> None:
        self.project_name = project_name

    @overload
    def __call__(self, function: F, firstresult: bool = False, historic: bool = False,
                 warn_on_impl: Warning | None = None, warn_on_impl_args: Mapping[str, Warning] | None = None) -> F: ...

    @overload
    def __call__(self, function: None = None, firstresult: bool = False, historic: bool = False,
                 warn_on_impl: Warning | None = None,
                 warn_on_impl_args: Mapping[str, Warning] | None = None) -> Callable[[F], F]: ...

    def __call__(self, function: F | None = None, firstresult: bool = False, historic: bool = False,
                 warn_on_impl: Warning | None = None, warn_on_impl_args: Mapping[str, Warning] | None = None) -> Any:
        if historic and firstresult:
            raise ValueError("cannot have a historic firstresult hook")
        opts = {"firstresult": firstresult, "historic": historic, "warn_on_impl": warn_on_impl,
                "warn_on_impl_args": warn_on_impl_args}

        def mark(func: F) -> F:
            setattr(func, self.project_name + "_spec", dict(opts))
            return func

        return mark if function is None else mark(function)


class HookimplMarker:
    """``@hookimpl`` or ``@hookimpl(tryfirst=True, ...)``, with pluggy's options and meaning."""

    __slots__ = ("project_name",)

    def __init__(self, project_name: str) -> None:
        self.project_name = project_name

    @overload
    def __call__(self, function: F, hookwrapper: bool = False, optionalhook: bool = False, tryfirst: bool = False,
                 trylast: bool = False, specname: str | None = None, wrapper: bool = False) -> F: ...

    @overload
    def __call__(self, function: None = None, hookwrapper: bool = False, optionalhook: bool = False,
                 tryfirst: bool = False, trylast: bool = False, specname: str | None = None,
                 wrapper: bool = False) -> Callable[[F], F]: ...

    def __call__(self, function: F | None = None, hookwrapper: bool = False, optionalhook: bool = False,
                 tryfirst: bool = False, trylast: bool = False, specname: str | None = None,
                 wrapper: bool = False) -> Any:
        opts = {"wrapper": wrapper, "hookwrapper": hookwrapper, "optionalhook": optionalhook, "tryfirst": tryfirst,
                "trylast": trylast, "specname": specname}

        def mark(func: F) -> F:
            setattr(func, self.project_name + "_impl", dict(opts))
            return func

        return mark if function is None else mark(function)


hookspec = HookspecMarker(PROJECT)
hookimpl = HookimplMarker(PROJECT)
