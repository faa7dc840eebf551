"""The one walker over nested inputs and outputs (fastdp/_tree.py): DataParallel's rules."""

import collections
import dataclasses

import torch

from fastdp import _tree

Pair = collections.namedtuple("Pair", "a b")


class MyDict(dict):
    pass


class MyList(list):
    pass


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    loss: object = None


def test_inputs_round_trip_with_dataparallels_container_rules():
    t = [torch.randn(2) for _ in range(5)]
    obj = (t[0], Pair(t[1], "s"), MyDict(k=[t[2], 3]), MyList([t[3], ()]), {"e": {}, "z": t[4]})
    leaves: list = []
    spec = _tree.flatten(obj, leaves)
    assert [id(x) for x in leaves] == [id(x) for x in t]
    back = _tree.build(spec, leaves)
    assert back[0] is t[0] and isinstance(back[1], Pair) and back[1].b == "s"
    assert type(back[2]) is MyDict and back[2]["k"][1] == 3
    assert type(back[3]) is list  # DataParallel's scatter gives plain lists and tuples
    assert back[3][1] == () and back[4]["e"] == {}  # empty containers go by reference


def test_outputs_keep_container_types_empty_containers_and_dataclasses():
    out = (MyList([torch.ones(1)]), Out(torch.zeros(2), "x"), [], None)
    leaves, objects = [], []
    spec = _tree.flatten(out, leaves, objects)
    assert len(leaves) == 2 and objects == ["x", None]
    back = _tree.build(spec, [x + 1 for x in leaves], lambda k: objects[k])
    assert type(back[0]) is MyList and back[2] == [] and back[3] is None
    assert isinstance(back[1], Out) and back[1].loss == "x" and back[1].logits.eq(1).all()


def test_paths_name_every_leaf():
    leaves: list = []
    spec = _tree.flatten(((torch.ones(1), Pair(torch.ones(1), 0)), {"m": torch.ones(1)}), leaves)
    assert _tree.paths(spec, "x", {}) == {0: "x[0][0]", 1: "x[0][1].a", 2: "x[1]['m']"}


def test_structure_key_ignores_object_values_but_not_types_or_keys():
    def key(obj):
        return _tree.structure_key(_tree.flatten(obj, []))

    assert key((torch.ones(2), 1)) == key((torch.ones(3), 2))
    assert key((torch.ones(2), 1)) != key((torch.ones(2), "1"))
    assert key({"a": torch.ones(1)}) != key({"b": torch.ones(1)})
    hash(key({"a": [torch.ones(1), Pair(1, 2)]}))


def test_first_tensor_and_map_tensors():
    a, b = torch.ones(1), torch.zeros(2)
    assert _tree.first_tensor(([], {"k": ("s", a)}, b)) is a
    assert _tree.first_tensor((1, "s", {})) is None
    doubled = _tree.map_tensors({"x": (a, 3)}, lambda t: t * 2)
    assert doubled["x"][1] == 3 and doubled["x"][0].item() == 2
    assert _tree.map_tensors("no tensors", lambda t: t) == "no tensors"
