"""records.Record / FrozenRecord keep the meaning of the dataclasses they replaced: field-wise repr and equality
within a class, mutable records unhashable, frozen ones hashable and read-only, copies, pickles, pattern matching
and ``replace``."""

from __future__ import annotations

import copy
import pickle

import pytest
from onnx_runtime.contract import Availability, KernelMatch
from onnx_runtime.contract.executor_artifacts import ExecutorArtifactReadinessEpoch
from onnx_runtime.contract.validation import DeviceValidationOwner, DeviceValidationRegistration
from onnx_runtime.devices import DeviceId, DeviceType
from onnx_runtime.ir import Node, TypeInfo, ValueInfo
from onnx_runtime.records import FrozenFieldError


def test_frozen_records_compare_hash_and_refuse_assignment():
    device = DeviceId(DeviceType.CUDA, 1)
    assert device == DeviceId(DeviceType.CUDA, 1) and device != DeviceId(DeviceType.CUDA, 2)
    assert hash(device) == hash(DeviceId(DeviceType.CUDA, 1)) and len({device, DeviceId(DeviceType.CUDA, 1)}) == 1
    assert repr(device) == "DeviceId(type=<DeviceType.CUDA: 'cuda'>, index=1, host_accessible_override=None)"
    assert KernelMatch(True) != Availability(True)  # (another class: never equal, as dataclasses)
    with pytest.raises(FrozenFieldError, match="index"):
        device.index = 2  # type: ignore[misc]
    with pytest.raises(AttributeError):
        del device.type  # type: ignore[misc]
    assert device.index == 1


def test_frozen_records_copy_pickle_match_and_replace():
    match = KernelMatch.unsupported("needs float32")
    for twin in (copy.copy(match), copy.deepcopy(match), pickle.loads(pickle.dumps(match))):
        assert twin == match and twin is not match
    match_args = KernelMatch.__match_args__
    assert match_args == ("is_supported", "cost", "reason")
    match match:
        case KernelMatch(False, _, reason):
            assert reason == "needs float32"
        case _:
            pytest.fail("positional pattern did not match")
    cheaper = match.replace(cost=0.5)
    assert (cheaper.cost, cheaper.reason, match.cost) == (0.5, "needs float32", 1.0)


def test_mutable_records_are_unhashable_and_fresh_defaults():
    info = ValueInfo("x")
    assert info == ValueInfo("x", TypeInfo()) and info.type is not ValueInfo("y").type
    info.doc = "changed"
    assert info != ValueInfo("x")
    with pytest.raises(TypeError):
        hash(info)
    node = Node("Relu", ["x"], ["y"])
    assert node.attrs == {} and node.attrs is not Node("Relu", ["x"], ["y"]).attrs
    assert pickle.loads(pickle.dumps(info)) == info


def test_identity_records_and_ordered_epochs():
    owner = DeviceValidationOwner(7)
    first, second = DeviceValidationRegistration(owner), DeviceValidationRegistration(owner)
    assert first == first and first != second and len({first, second}) == 2  # eq=False: identity
    node = Node("Relu", ["x"], ["y"])
    assert node != Node("Relu", ["x"], ["y"]) and hash(node) == hash(node)
    low, high = ExecutorArtifactReadinessEpoch(1), ExecutorArtifactReadinessEpoch(2)
    assert low < high <= high and high > low >= low and sorted([high, low]) == [low, high]
    with pytest.raises(TypeError):
        _ = low < 2  # type: ignore[operator]
