"""What a session tells of its model, as onnxruntime's API does: its inputs' and outputs' descriptions
(``get_inputs``, ``get_outputs``) and the model's metadata (``get_modelmeta``)."""

from __future__ import annotations

from ..ir import ValueInfo
from ..records import FrozenRecord


class NodeArg(FrozenRecord):
    """A graph input or output as onnxruntime describes it."""

    __slots__ = __match_args__ = ("name", "type", "shape")
    name: str
    type: str
    shape: list

    def __init__(self, name: str, type: str, shape: list) -> None:
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "type", type)
        object.__setattr__(self, "shape", shape)

    @classmethod
    def of(cls, vi: ValueInfo) -> NodeArg:
        t = vi.type
        if t.kind == "tensor":
            type_name = f"tensor({t.dtype})" if t.dtype is not None else "tensor(undefined)"
            shape = [d for d in t.shape] if t.shape is not None else []
        elif t.kind in ("sequence", "optional"):
            type_name = f"{t.kind}({NodeArg.of(ValueInfo('', t.elem)).type if t.elem else 'undefined'})"
            shape = []
        else:
            type_name, shape = t.kind, []
        return cls(vi.name, type_name, shape)


class ModelMetadata(FrozenRecord):
    """The model's metadata as onnxruntime's ``get_modelmeta`` returns it."""

    __slots__ = __match_args__ = ("producer_name", "graph_name", "domain", "description", "graph_description",
                                  "version", "custom_metadata_map")
    producer_name: str
    graph_name: str
    domain: str
    description: str
    graph_description: str
    version: int
    custom_metadata_map: dict

    def __init__(self,
                 producer_name: str, graph_name: str, domain: str, description: str, graph_description: str,
                 version: int, custom_metadata_map: dict | None = None) -> None:
        object.__setattr__(self, "producer_name", producer_name)
        object.__setattr__(self, "graph_name", graph_name)
        object.__setattr__(self, "domain", domain)
        object.__setattr__(self, "description", description)
        object.__setattr__(self, "graph_description", graph_description)
        object.__setattr__(self, "version", version)
        object.__setattr__(self, "custom_metadata_map", {} if custom_metadata_map is None else custom_metadata_map)
