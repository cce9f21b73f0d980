"""CodeTable (code_tables.fuse_code_tables): an elementwise chain of one 8-bit tensor and constant scalars, as a
table of its result for each of the 256 codes.

Inputs (codes, constants...): the chain's code tensor, then the constants its nodes read, in the order of
attribute ``names`` (attributes ``chain``, ``wiring`` and ``{index}.{name}`` hold the chain's nodes:
table_chains.py). The table is made with the chain's own node kernels, run once on the 256 codes, when the node
first runs with a code type, and again only when other constant arrays come in.
"""

from __future__ import annotations

import numpy as np

from ..algorithms.quantize import apply_table
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error
from .table_chain import TableChain, broadcast_rank

_EIGHT_BIT = (np.dtype(np.uint8), np.dtype(np.int8))
_CODE_COUNT = 256


@register("CodeTable", domain=FUSED_DOMAIN, since=1)
def code_table(node, shapes, opset):
    chain = TableChain(node)
    expected = len(chain.names)
    state: dict = {"constants": (), "tables": {}}  # the constants last seen, and the tables made with them per type

    def kernel(x, *constants):
        if len(constants) + 1 != expected:
            raise argument_error(node, f"takes {expected} inputs (the codes and the chain's constants); got "
                                 f"{len(constants) + 1}")
        dtype = x.dtype
        if dtype not in _EIGHT_BIT:
            raise argument_error(node, f"input {chain.names[0]!r} is {dtype}; expected uint8 or int8 codes "
                                 f"(the chain's QOperator input)")
        tables = state["tables"]
        if len(constants) != len(state["constants"]) or not all(map(_same, constants, state["constants"])):
            tables.clear()  # other constants: every table is made again
            state["constants"] = constants
        found = tables.get(dtype)
        if found is None:
            codes = np.arange(_CODE_COUNT, dtype=np.uint8).view(dtype)  # indexed by the code's byte
            found = tables[dtype] = chain.evaluate(codes, constants, None, "codes")
        table, rank = found
        out = apply_table(table, x)
        return (broadcast_rank(out, rank),)

    return kernel


def _same(a, b) -> bool:
    return a is b
