"""Deferred device-validation identities.

Device kernels that can fail on data (an index out of range) set bits in a device flag word
instead of corrupting memory. The flags are read at the next host-visible boundary. A provider may
be shared by several sessions, so each executor or persistent binding registers an *owner* once at
setup; each top-level submission is a *generation* of that owner, named by a token. Only the exact
owner (or an output binding that received the token as a recipient) may consume the result.
"""

from __future__ import annotations

from typing import Any

from ..records import FrozenRecord, Record
from .graphs import IdentitySpace

_OWNERS = IdentitySpace()  # validation owners' identities, a space apart from graph owners'


class DeviceValidationOwner(FrozenRecord):
    __slots__ = __match_args__ = ("id",)
    id: int

    def __init__(self, id: int) -> None:
        object.__setattr__(self, "id", id)

    @classmethod
    def new(cls) -> DeviceValidationOwner:
        return cls(_OWNERS.mint())


class DeviceValidationRegistration(Record):
    """Setup-time proof that ``owner`` is registered with a provider; ``state`` is provider-private."""

    __slots__ = __match_args__ = ("owner", "state")
    owner: DeviceValidationOwner
    state: Any

    def __init__(self, owner: DeviceValidationOwner, state: Any = None) -> None:
        self.owner = owner
        self.state = state

    __eq__ = object.__eq__  # (one registration is equal only to itself, and hashable)
    __hash__ = object.__hash__


class DeviceValidationToken(FrozenRecord):
    """Exact identity of one submitted validation generation."""

    __slots__ = __match_args__ = ("owner", "generation")
    owner: DeviceValidationOwner
    generation: int

    def __init__(self, owner: DeviceValidationOwner, generation: int) -> None:
        object.__setattr__(self, "owner", owner)
        object.__setattr__(self, "generation", generation)
