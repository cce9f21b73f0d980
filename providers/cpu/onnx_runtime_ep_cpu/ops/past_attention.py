"""PastAttention (past_attention.py's fold): a decoder layer's two cache appends, its attention over the grown
cache and, with ``merge_shape``, the merge of Y's heads, as one kernel.

Inputs (q, k, v, mask, past_key, past_value), 4-D (batch, heads, sequence, head size) as the Attention's; outputs
(Y, present_key, present_value) with present = Concat(past, new) on the keys' axis. The appends go through
kv_append.append (in place in the bound run's cache buffer, else a concatenation), and the attention is the ONNX
Attention kernel of the node it replaced, built for the grown cache's shapes, whose decode path then reads the
cache where the append left it. Y is Reshape(Transpose(Y, (0, 2, 1, 3)), merge_shape) where the merge folded (a
view at a decode step's one query row).
"""

from __future__ import annotations

import numpy as np
from onnx_runtime import kv_append
from onnx_runtime.ir import Node

from ..algorithms.attention_keys import length_free_key
from ..fused_domain import FUSED_DOMAIN
from ..registry import register
from ._common import argument_error
from .transformer import attention_23, attention_24, attention_25
from .view import reshape_to

_ATTENTIONS = {23: attention_23, 24: attention_24, 25: attention_25}
_HEADS = (0, 2, 1, 3)


def _grown(past, new) -> tuple | None:
    if past is None or new is None or len(past) != 4 or len(new) != 4:
        return None
    return tuple(past[:2]) + (past[2] + new[2],) + tuple(past[3:])


class _PastAttention:
    def __init__(self, node, shapes, opset):
        if len(node.inputs) != 6 or not all(node.inputs[i] for i in (0, 1, 2, 4, 5)) or len(node.outputs) != 3:
            raise argument_error(node, "PastAttention takes (q, k, v, mask or '', past_key, past_value) and gives "
                                       "(Y, present_key, present_value)")
        shapes = list(shapes) + [None] * (6 - len(shapes))
        q, k, v, mask, past_key, past_value = shapes[:6]
        present_key, present_value = _grown(past_key, k), _grown(past_value, v)
        if q is None or len(q) != 4 or present_key is None or present_value is None:
            raise argument_error(node, f"q, k, v and the pasts must be 4-D (batch, heads, sequence, head size); "
                                       f"got shapes {shapes}")
        attrs = {name: value for name, value in node.attrs.items() if name != "merge_shape"}
        has_mask = bool(node.inputs[3])
        inner = Node("Attention", ["q", "k", "v", "mask"] if has_mask else ["q", "k", "v"], [node.outputs[0]],
                     name=node.name, attrs=attrs, opset=node.opset)
        factory = _ATTENTIONS[max(version for version in _ATTENTIONS if version <= max(node.opset, 23))]
        inner_shapes = [q, present_key, present_value] + ([mask] if has_mask else [])
        self.attention = factory(inner, inner_shapes, max(node.opset, 23))
        self.has_mask = has_mask
        self.outputs = (node.outputs[1], node.outputs[2])
        merge = node.attr("merge_shape")
        self.merge = None if merge is None else [int(d) for d in merge]
        self.merged = None if self.merge is None or 0 in self.merge or min(self.merge) < -1 else tuple(self.merge)
        if getattr(self.attention, "shape_key", None) is not None:  # (reads the keys' length per call)
            self.shape_key = length_free_key
            self._key = length_free_key(tuple(tuple(shape) if shape is not None else None for shape in shapes))
            self._q, self._k, self._v = tuple(q), tuple(k), tuple(v)
            self._mask_lead = tuple(mask[:-1]) if has_mask and mask is not None else None
            self._few_lead: tuple | None | bool = False  # (the attention's read of that mask, found at a first fit)
            # (the pasts span what K and V span but the length: what a window's admission checks of both)
            past_key, past_value = tuple(past_key), tuple(past_value)
            if has_mask == (mask is not None) and past_key[:2] + past_key[3:] == self._k[:2] + self._k[3:] \
                    and past_value[:2] + past_value[3:] == self._v[:2] + self._v[3:]:
                self._fits = True

    _fits = False  # (whether call_if_fits applies: see __init__)

    @property
    def call_if_fits(self):
        """ShapeKeyedKernel's checked call where this kernel has one, else None (a property, not the bound method
        kept: that would be a reference cycle, kept until a cyclic collection after its session is dropped)."""
        return self._call_if_fits if self._fits else None

    def __call__(self, q, k, v, mask, past_key, past_value):
        y = self._over_window(q, k, v, mask, past_key, past_value)
        return y if y is not None else self._concatenated(q, k, v, mask, past_key, past_value)

    def _call_if_fits(self, q, k, v, mask, past_key, past_value):
        """The call for inputs of this kernel's length-free key (see ShapeKeyedKernel), else None with nothing
        done. A decode step's Q, K, V and mask lead as at the kernel's first call, with both pasts admitted to
        their windows (which span what K and V span but the length), need no other check."""
        lead = self._mask_lead
        if q.shape == self._q and k.shape == self._k and v.shape == self._v \
                and (lead is None or mask.shape[:-1] == lead):
            y = self._over_fitting_window(q, k, v, mask, past_key, past_value)
            if y is not None:
                return y
        shapes = tuple(tuple(x.shape) if x is not None else None for x in (q, k, v, mask, past_key, past_value))
        if length_free_key(shapes) != self._key:
            return None
        return self._concatenated(q, k, v, mask, past_key, past_value)

    def _over_window(self, q, k, v, mask, past_key, past_value):
        # A decode step over the bound cache: the appends and the attention in one compiled call, which writes
        # the rows kv_append admits and reads the cache where they landed (both caches asked for at once: a
        # decode step's other work is a few microseconds, so each lookup shows). None where it does not apply.
        found = kv_append.admitted_pair(self.outputs, (past_key, past_value), (k, v), 2)
        if found is not None:
            key_window, value_window, length = found
            y = self.attention.append_over_rows(q, k, v, mask if self.has_mask else None, key_window.physical,
                                                value_window.physical, length)
            if y is not None:
                present_key, present_value = kv_append.claim_pair(key_window, value_window, length,
                                                                  length + k.shape[2])
                if y is False:  # (the rows are in place; a row without a finite score goes the attention's own way)
                    y = self._attend(q, present_key, present_value, mask)
                return self._merged(y), present_key, present_value
        return None

    def _over_fitting_window(self, q, k, v, mask, past_key, past_value):
        # _over_window for inputs _call_if_fits matched: the mask's lead is this kernel's, so the attention's read
        # of it (few_mask_lead) is found once, not looked up by shape every step.
        found = kv_append.admitted_pair(self.outputs, (past_key, past_value), (k, v), 2)
        if found is not None:
            key_window, value_window, length = found
            mask_lead = self._few_lead
            if mask_lead is False:
                mask_lead = self._few_lead = None if mask is None or not self.has_mask else \
                    self.attention.few_mask_lead(mask.shape, q.shape[0])
            y = self.attention.append_over_windows(q, k, v, mask if self.has_mask else None, mask_lead, key_window,
                                                   value_window, length)
            if y is not None:
                present_key, present_value = kv_append.claim_pair(key_window, value_window, length,
                                                                  length + k.shape[2])
                if y is False:  # (as _over_window)
                    y = self._attend(q, present_key, present_value, mask)
                return self._merged(y), present_key, present_value
        return None

    def _concatenated(self, q, k, v, mask, past_key, past_value):
        key_name, value_name = self.outputs
        keys = kv_append.append_window(key_name, (past_key, k), 2)
        values = kv_append.append_window(value_name, (past_value, v), 2)
        present_key = np.concatenate((past_key, k), axis=2) if keys is None else keys.result
        present_value = np.concatenate((past_value, v), axis=2) if values is None else values.result
        found = None if keys is None or values is None else \
            self.attention.few_over_rows(q, present_key, present_value, mask, keys.physical, values.physical)
        y = found[0] if found is not None else self._attend(q, present_key, present_value, mask)
        return self._merged(y), present_key, present_value

    def _attend(self, q, present_key, present_value, mask):
        return self.attention(q, present_key, present_value, mask)[0] if self.has_mask else \
            self.attention(q, present_key, present_value)[0]

    def _merged(self, y):
        if self.merged is not None:
            # (one query row: Y's (B, H, 1, D) lies as its merge's (B, 1, H, D) does, so the merge is a reshape)
            return y.reshape(self.merged) if y.shape[2] == 1 else y.transpose(_HEADS).reshape(self.merged)
        if self.merge is not None:
            return reshape_to(y.transpose(_HEADS), self.merge)
        return y


@register("PastAttention", domain=FUSED_DOMAIN, since=1)
def past_attention(node, shapes, opset):
    return _PastAttention(node, shapes, opset)
