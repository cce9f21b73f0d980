"""Deferred device-validation identities.

Device kernels that can fail on data (an index out of range) set bits in a device flag word
instead of corrupting memory. The flags are read at the next host-visible boundary. A provider may
be shared by several sessions, so each executor or persistent binding registers an *owner* once at
setup; each top-level submission is a *generation* of that owner, named by a token. Only the exact
owner (or an output binding that received the token as a recipient) may consume the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .graphs import IdentitySpace

_OWNERS = IdentitySpace()  # validation owners' identities, a space apart from graph owners'


@dataclass(frozen=True, slots=True)
class DeviceValidationOwner:
    id: int

    @classmethod
    def new(cls) -> DeviceValidationOwner:
        return cls(_OWNERS.mint())


@dataclass(eq=False, slots=True)
class DeviceValidationRegistration:
    """Setup-time proof that ``owner`` is registered with a provider; ``state`` is provider-private."""

    owner: DeviceValidationOwner
    state: Any = field(default=None)


@dataclass(frozen=True, slots=True)
class DeviceValidationToken:
    """Exact identity of one submitted validation generation."""

    owner: DeviceValidationOwner
    generation: int
