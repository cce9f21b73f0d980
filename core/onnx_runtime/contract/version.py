"""The contract's version, and which providers a core of this version serves.

A provider says which version it was written for (its ``contract_version`` hook, "MAJOR.MINOR"). A core serves a
provider of its own major version written for the same or an earlier minor version: minor versions only add hooks,
each with a default, and a provider of an earlier minor gets the defaults of what it does not know. A provider
written for a later minor may rely on hooks this core would never call, and one of another major version on
semantics this core does not have: those are reported unavailable, with the reason. docs/contract-changelog.md
lists what each version changed.
"""

from __future__ import annotations

import re

VERSION = "1.5"
FIRST_VERSION = "1.0"  # what a provider that does not declare a version is taken to be written for

_FORMAT = re.compile(r"^(\d+)\.(\d+)$")


def parse(version: str) -> tuple[int, int]:
    """``"1.2"`` as ``(1, 2)``; anything else is a ValueError naming the expected form."""
    match = _FORMAT.match(version) if isinstance(version, str) else None
    if match is None:
        raise ValueError(f"a contract version is 'MAJOR.MINOR' (e.g. {VERSION!r}), got {version!r}")
    return int(match.group(1)), int(match.group(2))


def incompatibility(declared: str) -> str | None:
    """Why a provider written for contract ``declared`` cannot be served by this core, or None when it can."""
    major, minor = parse(declared)
    core_major, core_minor = parse(VERSION)
    if major != core_major:
        return (f"it was written for provider contract {declared}, and this onnx-runtime implements {VERSION}; "
                f"use a release of the provider written for contract {core_major}.x")
    if minor > core_minor:
        return (f"it was written for provider contract {declared}, newer than the {VERSION} this onnx-runtime "
                f"implements; upgrade onnx-runtime")
    return None
