"""Declared shape rules (onnx_runtime/session/shape_rules.py): a declaration is checked, a repeat is accepted and a
conflicting one is refused."""

from __future__ import annotations

import pytest
from onnx_runtime.session import shape_rules


@pytest.fixture
def rules(monkeypatch):
    monkeypatch.setattr(shape_rules, "_RULES", {})
    return shape_rules


def test_a_declaration_is_kept_once_and_a_conflicting_one_refused(rules):
    rules.declare("test.domain", "Same", rules.FIRST)
    rules.declare("test.domain", "Same", rules.FIRST, (0,))  # the same rule again, spelled out
    rules.declare("test.domain", "Product", rules.MATMUL, (0, 3))
    assert rules.rule_of("test.domain", "Same") == rules.ShapeRule(rules.FIRST, (0,))
    assert rules.declared("test.domain") == {"Same": rules.ShapeRule(rules.FIRST, (0,)),
                                             "Product": rules.ShapeRule(rules.MATMUL, (0, 3))}
    with pytest.raises(ValueError, match="test.domain:Same declared as .* and as"):
        rules.declare("test.domain", "Same", rules.FIRST, (1,))
    with pytest.raises(ValueError, match="test.domain:Product declared as"):
        rules.declare("test.domain", "Product", rules.SHAPES)


def test_a_declaration_names_what_it_got_wrong(rules):
    with pytest.raises(ValueError, match="kind 'sideways'; expected one of"):
        rules.declare("test.domain", "Odd", "sideways")
    with pytest.raises(ValueError, match="matmul takes 2 operand indices, not \\(0,\\)"):
        rules.declare("test.domain", "Odd", rules.MATMUL, (0,))
    with pytest.raises(ValueError, match="broadcast takes two or more operand indices"):
        rules.declare("test.domain", "Odd", rules.BROADCAST, (0,))
    with pytest.raises(ValueError, match="concat takes 1 operand"):
        rules.declare("test.domain", "Odd", rules.CONCAT, (1, 2))
    assert rules.rule_of("test.domain", "Odd") is None
