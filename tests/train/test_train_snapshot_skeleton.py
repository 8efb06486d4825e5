"""The skeleton pickler (``train/snapshots/skeleton.py``) reduces through a dispatch table that
it fills once per type: it must pickle every object as the plain pickler does, except plain
tensors (references into the data region) and sharded tensors (refused). Here: tensor
subclasses, tensors it cannot reference, classes with metaclasses, enums, ``copyreg``
reductions registered (or registered again) after the table was filled, a subclass of a
sharded tensor type, and a skeleton written by an earlier version (its references under the
old module name)."""

from __future__ import annotations

import copyreg
import enum
import io
import pickle
from typing import Any

import pytest
import torch

from elasticstore.train.snapshots.skeleton import ShardedFound, SkeletonPickler, SkeletonUnpickler


class Color(enum.Enum):
    RED = 1


class Meta(type):
    pass


class WithMeta(metaclass=Meta):
    pass


class Point:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Point) and other.x == self.x


def round_trip(state: Any) -> tuple[Any, int]:
    """``state`` pickled and read back as a snapshot is (its tensors copied into a data region);
    the number of tensors given references."""
    out = io.BytesIO()
    p = SkeletonPickler(out, (), 64)
    p.dump(state)
    data = torch.zeros(max(p.size, 1), dtype=torch.uint8)
    for t, (_, _, offset) in zip(p.tensors, p.layout):
        data[offset:offset + t.nbytes].copy_(t.contiguous().view(-1).view(torch.uint8))
    return SkeletonUnpickler(io.BytesIO(out.getvalue()), data).load(), len(p.tensors)


def test_objects_pickle_as_the_plain_pickler_does() -> None:
    param = torch.nn.Parameter(torch.arange(3.0))
    state: dict[str, Any] = {"param": param, "color": Color.RED, "cls": WithMeta, "meta": Meta, "point": Point(3),
             "sparse": torch.eye(2).to_sparse(), "nested": [(1, None), {"a": 2.5}],
             "t": torch.arange(6.0).reshape(2, 3).t(), "same": None}
    state["same"] = state["t"]  # one object twice: one reference, the same object read back
    got, referenced = round_trip(state)
    # the plain tensor, and the plain tensors of the Parameter's and the sparse tensor's reductions
    # (its data; its indices and values)
    assert referenced == 4
    assert isinstance(got["param"], torch.nn.Parameter) and torch.equal(got["param"], param)
    assert got["color"] is Color.RED and got["cls"] is WithMeta and got["meta"] is Meta
    assert got["point"] == Point(3) and got["nested"] == [(1, None), {"a": 2.5}]
    assert torch.equal(got["sparse"].to_dense(), torch.eye(2))
    assert torch.equal(got["t"], state["t"]) and got["same"] is got["t"]


def test_a_copyreg_reduction_registered_later_is_used() -> None:
    round_trip({"p": Point(1)})  # the table now holds Point's default reduction
    copyreg.pickle(Point, lambda p: (Point, (p.x * 10,)))
    try:
        got, _ = round_trip({"p": Point(2)})
        assert got["p"] == Point(20)
    finally:
        del copyreg.dispatch_table[Point]
    got, _ = round_trip({"p": Point(2)})
    assert got["p"] == Point(2)


def test_a_copyreg_reduction_registered_again_replaces_the_first() -> None:
    copyreg.pickle(Point, lambda p: (Point, (p.x * 10,)))
    try:
        got, _ = round_trip({"p": Point(2)})  # the table now holds this reduction
        assert got["p"] == Point(20)
        copyreg.pickle(Point, lambda p: (Point, (p.x * 100,)))  # as many entries as before
        got, _ = round_trip({"p": Point(2)})
        assert got["p"] == Point(200)
    finally:
        del copyreg.dispatch_table[Point]


class Sharded(torch.Tensor):
    pass


class Sub(Sharded):
    pass


def test_a_subclass_of_a_sharded_type_is_refused() -> None:
    value = torch.zeros(2).as_subclass(Sub)
    with pytest.raises(ShardedFound):
        SkeletonPickler(io.BytesIO(), (Sharded,), 64).dump({"w": value})
    # the table decided again for the sharded types of this call: the same type is allowed
    SkeletonPickler(io.BytesIO(), (), 64).dump({"w": value})


def test_a_skeleton_of_an_earlier_version_is_read() -> None:
    args = pickle.dumps((torch.float32, (2,), 0, 8), protocol=0)[:-1]  # no STOP
    stream = b"celasticstore.train.snapshots.fileformat\n_tensor_ref\n" + args + b"R."
    data = torch.tensor([1.5, 2.5]).view(torch.uint8)
    got = SkeletonUnpickler(io.BytesIO(stream), data).load()
    assert torch.equal(got, torch.tensor([1.5, 2.5]))

