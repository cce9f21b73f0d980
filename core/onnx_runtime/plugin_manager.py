"""pluggy's manager for one provider handle (provider_handle.py builds it at the first ask: plugins registered on
the handle, or a provider whose hooks pluggy must read)."""

from __future__ import annotations

import types

import pluggy


class ContractManager(pluggy.PluginManager):
    """pluggy's manager, skipping dunder names when it looks for hook specifications and implementations:
    no hook of the contract is one, and they are most of what ``dir()`` lists (27 of the CPU provider's
    33 names). pluggy inspects each name statically (``inspect.getattr_static``), a cost every session
    creation paid for the provider, its fallbacks and the specification (measured in 812ef5d)."""

    def __init__(self, project_name: str):
        super().__init__(project_name)
        self._spec_marker = project_name + "_spec"

    def parse_hookimpl_opts(self, plugin, name: str):
        return None if name.startswith("__") else super().parse_hookimpl_opts(plugin, name)

    def parse_hookspec_opts(self, module_or_class, name: str):
        if name.startswith("__"):
            return None
        if isinstance(module_or_class, type):  # a plain function found in the class's own namespaces: its marker
            for owner in module_or_class.__mro__:  # (what pluggy's static lookup returns, without its checks)
                if name in owner.__dict__:
                    found = owner.__dict__[name]
                    if isinstance(found, types.FunctionType):
                        opts = getattr(found, self._spec_marker, None)
                        return opts if isinstance(opts, dict) else None
                    break
        return super().parse_hookspec_opts(module_or_class, name)
