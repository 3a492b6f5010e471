"""ModuleWatch: what the per-call check sees of a module's tensors and attributes.

Each signal is read for every tensor in one loop in C (``autoopt.module.watch``); these tests pin
that the fast reads still see every kind of change the slow ones saw: a slot given another
tensor, an in-place write, a write through ``.data`` (no version counter sees it), memory
swapped under a parameter, a Python attribute, on plain tensors and on a tensor subclass
(sampled through torch views instead of the raw gather). The per-call check skips the walk of
slots and attributes while the dicts' version tags hold still: every change the walk sees
must move them.
"""

from __future__ import annotations

import copy
import pickle
import sys
import types

import pytest
import torch
from torch import nn

from autoopt.module import watch as watch_module
from autoopt.module.watch import ModuleWatch


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


def test_a_replaced_submodule_is_a_replaced_slot() -> None:
    m = model()
    watch = watched(m)
    m[2] = nn.Linear(8, 4)  # the graphs hold the old one's weights
    assert watch.replaced() and watch.reassigned()


def test_tags_are_read_where_cpython_keeps_them() -> None:
    """The fast path is on where it can be: a failed self-test would silently cost the walk
    on every call."""
    keeps = sys.implementation.name == "cpython" and (3, 10) <= sys.version_info[:2] <= (3, 12)
    assert watch_module._TAGS_TRACK_CHANGES == keeps


def configured() -> nn.Module:
    m = model()
    m[1].config = types.SimpleNamespace(scale=1.0)  # an object the module reads settings from
    return m


CHANGES = {
    "attribute": lambda m: setattr(m[1], "momentum", 0.5),
    "attribute, same value, new object": lambda m: setattr(m[1], "eps", 1e-5 + 0.0),
    "attribute through __dict__": lambda m: m[1].__dict__.__setitem__("eps", 0.5),
    "attribute deleted": lambda m: delattr(m[1], "momentum"),
    "config attribute": lambda m: setattr(m[1].config, "scale", 2.0),
    "train mode": lambda m: m[1].train(),
    "training through __dict__": lambda m: m[0].__dict__.__setitem__("training", True),
    "parameter assigned": lambda m: setattr(m[0], "weight", nn.Parameter(torch.randn(8, 8))),
    "slot written": lambda m: m[0]._parameters.__setitem__("bias", torch.zeros(8)),
    "buffer deleted": lambda m: m[1]._buffers.pop("running_mean"),
    "submodule replaced": lambda m: m.__setitem__(2, nn.Linear(8, 4)),
    "submodule deleted": lambda m: m._modules.pop("2"),
}


@pytest.mark.skipif(not watch_module._TAGS_TRACK_CHANGES, reason="no dict version tags here")
@pytest.mark.parametrize("change", CHANGES)
def test_every_change_the_walk_sees_moves_the_tags(change: str) -> None:
    m = configured()
    watch = watched(m)
    token = watch.tags()
    for _ in range(3):
        assert watch.tags() == token  # nothing changed: the walk can be skipped
    CHANGES[change](m)
    assert watch.tags() != token
    moved = watch.tags()
    assert watch.tags() == moved  # and holds still again


@pytest.mark.skipif(not watch_module._TAGS_TRACK_CHANGES, reason="no dict version tags here")
def test_a_refreshed_snapshot_never_matches_an_older_token() -> None:
    m = configured()
    watch = watched(m)
    token = watch.tags()
    watch.refresh_attributes()
    assert watch.tags() != token
    token = watch.tags()
    watch.refresh_tensors()
    assert watch.tags() != token


@pytest.mark.skipif(not watch_module._TAGS_TRACK_CHANGES, reason="no dict version tags here")
@pytest.mark.parametrize("copier", [copy.deepcopy, lambda w: pickle.loads(pickle.dumps(w))],
                         ids=["deepcopy", "pickle"])
def test_a_copy_reads_the_tags_of_its_own_dicts(copier) -> None:
    watch = watched(configured())
    watch.tags()
    twin = copier(watch)
    token = twin.tags()
    twin.module[1].momentum = 0.5
    assert twin.tags() != token
    token = watch.tags()
    watch.module[1].eps = 0.5
    assert watch.tags() != token


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int8, torch.bool,
                                   torch.float64, torch.complex64, torch.complex128])
def test_a_write_through_data_is_seen_in_every_element_width(dtype: torch.dtype) -> None:
    """Samples are read a word per element, one gather per word size and alignment: a
    tensor of each width (and one starting at an odd offset) keeps its own samples."""
    m = nn.Module()
    m.register_buffer("b", torch.zeros(64).to(dtype))
    m.register_buffer("odd", torch.zeros(65).to(dtype)[1:])  # at an odd element offset
    m.register_buffer("other", torch.zeros(16))
    watch = watched(m)
    assert watch.unchanged() and watch.rewritten() == set()
    for name in ("b", "odd"):
        getattr(m, name).data[0] = 1
        assert not watch.unchanged()
        assert watch.rewritten() == {id(getattr(m, name))}
        watch.take_fingerprint()


def test_a_module_pickled_before_the_tags_token_loads_and_follows_edits(monkeypatch) -> None:
    """An optimized module pickled by an autoopt that kept no ``_settled`` token."""
    import autoopt
    from autoopt.module.optimized import OptimizedModule

    net = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    x = torch.randn(2, 4)
    fast = autoopt.optimize(net, (x,), random_inputs=1)
    plain_state = OptimizedModule.__getstate__

    def without_token(self: OptimizedModule) -> dict:
        state = plain_state(self)
        state.pop("_settled", None)
        return state

    monkeypatch.setattr(OptimizedModule, "__getstate__", without_token)
    loaded = pickle.loads(pickle.dumps(fast))
    monkeypatch.undo()
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), loaded.module(x))
        loaded.module[0].weight.mul_(2)  # an edit after the first call still reaches it
        torch.testing.assert_close(loaded(x), loaded.module(x))


def test_a_users_torch_compile_does_not_trace_into_the_watch() -> None:
    """autoopt's registration hooks are global: Dynamo traced them into the user's own
    compiled forward, guarded on the entries of autoopt's weak dict of watches by position,
    and failed to build those guards once the dict changed (IndexError, transformers'
    static-cache recipe after an optimize in the same process)."""
    import autoopt

    class Registers(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.register_buffer("last", x.detach().sum(), persistent=False)
            return x * 2

    other = nn.Sequential(nn.Linear(4, 4)).eval()
    fast = autoopt.optimize(other, (torch.randn(2, 4),), random_inputs=1)  # a watch exists
    torch._dynamo.reset()
    explained = torch._dynamo.explain(Registers())(torch.randn(3))
    names = [str(getattr(g, "name", g)) for g in explained.out_guards or []]
    assert names and not [n for n in names if "_owners" in n], names
    assert fast is not None
