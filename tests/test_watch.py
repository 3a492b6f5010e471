"""ModuleWatch: what the per-call check sees of a module's tensors and attributes.

Each signal is read for every tensor in one loop in C (``autoopt.watch``); these tests pin
that the fast reads still see every kind of change the slow ones saw: a slot given another
tensor, an in-place write, a write through ``.data`` (no version counter sees it), memory
swapped under a parameter, a Python attribute, on plain tensors and on a tensor subclass
(sampled through torch views instead of the raw gather).
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
from torch import nn

from autoopt.watch import ModuleWatch


class Tagged(nn.Parameter):
    """A parameter subclass: sampled through torch views, not read by address."""


def model(subclass: bool = False) -> nn.Module:
    m = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 4)).eval()
    if subclass:
        m[2].weight = Tagged(m[2].weight.detach().clone())
    return m


def watched(m: nn.Module) -> ModuleWatch:
    watch = ModuleWatch(m)
    watch.take_fingerprint()
    return watch


@torch.no_grad()
@pytest.mark.parametrize("subclass", [False, True], ids=["plain", "subclass"])
@pytest.mark.parametrize("edit", ["in place", "through .data", "memory swapped",
                                  "statistic through .data"])
def test_every_write_is_seen(edit: str, subclass: bool) -> None:
    m = model(subclass)
    watch = watched(m)
    assert watch.unchanged() and watch.rewritten() == set()
    target = m[2].weight if edit != "statistic through .data" else m[1].running_var
    if edit == "in place":
        target.mul_(2)  # a version counter sees this one
        assert not watch.unchanged()
        return
    if edit == "memory swapped":
        target.data = torch.randn_like(target)
    else:
        target.data.mul_(3)
    assert not watch.unchanged()
    assert id(target) in watch.rewritten()


@torch.no_grad()
def test_a_swap_and_a_data_write_at_once_are_both_named() -> None:
    """One tensor's memory swapped, another's written through ``.data`` before the next
    check: both are rewritten (the swap alone was named, so a graph watching only the other
    tensor stayed)."""
    m = model()
    watch = watched(m)
    m[0].weight.data = torch.randn(8, 8)
    m[2].weight.data.mul_(0.5)
    assert watch.rewritten() == {id(m[0].weight), id(m[2].weight)}


def test_replaced_slots_and_attributes() -> None:
    m = model()
    watch = watched(m)
    assert not watch.replaced() and not watch.attributes_changed()
    m[1].eps = 1e-5 + 0.0  # the same value again: no change
    assert not watch.attributes_changed()
    m[1].momentum = 0.5
    assert watch.attributes_changed()
    del m[1].momentum
    assert watch.attributes_changed()
    m[2]._parameters["weight"] = nn.Parameter(torch.randn(4, 8))
    assert watch.replaced()
    del m[2]._parameters["bias"]
    assert watch.replaced()


@pytest.mark.parametrize("copier", [copy.deepcopy, lambda w: pickle.loads(pickle.dumps(w))],
                         ids=["deepcopy", "pickle"])
def test_a_copy_takes_no_fingerprint_of_the_original_memory(copier) -> None:
    watch = watched(model())
    twin = copier(watch)
    assert twin.unchanged()  # nothing to compare until it takes its own
    twin.take_fingerprint()
    twin.module[0].weight.data.mul_(2)
    assert not twin.unchanged() and watch.unchanged()
