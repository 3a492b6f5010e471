"""The eager probe a capture starts with: one call of the model on a copy of the inputs, to see
what a whole graph could not replay (hooks, Python state written on every call, a custom
autograd.Function), and to keep on autoopt's copy the state a first call writes once (a cache
computed from the parameters, hooks the model installs for itself), as eager's first call
would leave it."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from autoopt.capture.objects import foreign_types
from autoopt.check.compare import compare
from autoopt.check.inputs import clone_inputs, input_sets, leaves
from autoopt.check.state import (
    ABSENT,
    HookKey,
    StateKey,
    assign_attributes,
    attribute_copies,
    attribute_values,
    changed_state,
    has_hooks,
    hook_keys,
    own_buffers,
    preserved,
    python_state,
    remove_hooks,
    state_names,
    uses_custom_autograd,
)
from autoopt.compile.compiled import EagerRaised
from autoopt.errors import ModelError
from autoopt.options.config import OptimizeConfig

log = logging.getLogger(__name__)


class EagerProbe:
    """The probe's part of ``Capturer``: it reads ``module`` (autoopt's copy), ``_config``,
    ``own_hooks`` and ``_on_state_write``, and sets ``written``, ``_output_types`` and
    ``kept_state``."""

    module: nn.Module
    _config: OptimizeConfig
    own_hooks: set[HookKey]
    written: list[torch.Tensor]
    kept_state: bool

    def _probe(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[str]:
        """Run eagerly once (twice where the first call writes Python state); return why a
        whole-graph capture could not replay this model.

        Python state the first call writes and later calls leave as they find it (a cache of
        values computed from parameters, a flag set once, hooks the model installs for
        itself) is kept on this module, autoopt's copy, as eager's first call would leave it,
        when the second call computes what the first did: the graph is then captured as
        every later call runs (``_first_call_only``). State written on every call stays an
        obstacle. The user's model is never run here."""
        obstacles = []
        if has_hooks(self.module, ignore=self.own_hooks):
            obstacles.append("the model has forward/backward hooks, which a graph would run "
                             "only once at capture time")
        hooks = hook_keys(self.module)
        kept: dict[StateKey, Any] | None = None
        # On copies of the buffers: a forward that writes them must not write memory this
        # module may still share with the user's model (see on_state_write).
        with own_buffers(self.module) as copies, preserved(self.module):
            before, initial = python_state(self.module), attribute_copies(self.module)
            tensors = [t for t in (*self.module.parameters(), *self.module.buffers())
                       if not t.is_inference()]
            versions = [t._version for t in tensors]
            out = self._probe_call(args, kwargs)
            # The module's own tensors (not the copies) its forward writes in place.
            self.written = [copies.get(id(t), t) for t, v in zip(tensors, versions, strict=True)
                            if t._version != v]
            self._output_types = foreign_types(out)
            changed = changed_state(before, python_state(self.module))
            installed = hook_keys(self.module) - hooks
            if changed or installed:
                why, kept = self._first_call_only(args, kwargs, out, changed, copies,
                                                  initial)
                if why:
                    obstacles.append(why)
            if torch.is_grad_enabled() and uses_custom_autograd(out):
                obstacles.append("the model uses a custom autograd.Function, whose backward "
                                 "a traced graph would drop")
        if kept is not None:  # preserved put back the state from before: the first call's
            assign_attributes(self.module, kept)
            self.own_hooks |= installed
            self.kept_state = True
            log.info("capture: forward's first call writes %s, which later calls keep: kept "
                     "on autoopt's copy and captured as later calls run",
                     state_names(changed) or "hooks")
        else:
            remove_hooks(self.module, installed)  # the probe leaves no trace
        if self.written and self._on_state_write is not None:
            self._on_state_write()  # after the probe's writes were put back
        return obstacles

    def _probe_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One eager call on a copy of the inputs, from the buffers' values as they are (they
        are put back after it, with the RNG: each probe call sees the same). Where the model
        raises, ``EagerRaised``: the example's capture says so, a later call raises eager's
        own error."""
        with preserved(list(self.module.buffers())):
            probe_args, probe_kwargs = clone_inputs(args, kwargs)
            try:
                return self.module(*probe_args, **probe_kwargs)
            except Exception as exc:
                raise EagerRaised(exc) from exc

    def _first_call_only(self, args: tuple[Any, ...], kwargs: dict[str, Any], first: Any,
                         changed: list[StateKey], copies: dict[int, torch.Tensor],
                         initial: dict[StateKey, Any],
                         ) -> tuple[str, dict[StateKey, Any] | None]:
        """Call once more, after the probe's first call wrote ``changed`` (or installed
        hooks): the write is one a graph can own if this call writes nothing and computes
        what the first did, and if a first call on other inputs (from the ``initial``
        state) writes the same values: a cache of the example's own values would make the
        graph replay them for every input. Returns why not, or the state to keep."""
        names = state_names(changed)
        what = f"forward changes Python state ({names})" if changed else "forward adds hooks"
        expected = {p: v.detach().clone() if isinstance(v, torch.Tensor) else v
                    for p, v in leaves(first, "output")}
        after, hooks = python_state(self.module), hook_keys(self.module)
        try:
            second = self._probe_call(args, kwargs)
        except ModelError as exc:
            return f"{what}, after which a second call raises ({exc.__cause__})", None
        again = changed_state(after, python_state(self.module))
        if again:
            return (f"forward changes Python state ({state_names(again)}) on every call: a "
                    f"graph would replay the values of one call"), None
        if hook_keys(self.module) - hooks:
            return "forward adds hooks on every call", None
        result = compare(expected, dict(leaves(second, "output")),
                         self._config.verification_tolerances)
        if not result.ok:
            return (f"{what} on its first call and computes differently on later calls "
                    f"({result.detail})"), None
        kept = attribute_values(self.module, changed)
        held = [v for _, v in leaves(kept, "state") if isinstance(v, torch.Tensor)]
        if any(v.requires_grad for v in held):
            return f"{what}, keeping tensors with gradient history", None
        if {id(v) for v in held} & copies.keys():
            return f"{what}, keeping a buffer itself", None
        elsewhere = self._first_call_on_other_inputs(args, kwargs, changed, initial)
        if elsewhere is not None:
            result = compare(_state_values(kept), elsewhere, self._config.verification_tolerances)
            if not result.ok:
                return f"{what} from its inputs: a first call on other inputs writes " \
                       f"other values ({result.detail})", None
        return "", kept

    def _first_call_on_other_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any],
                                    changed: list[StateKey], initial: dict[StateKey, Any],
                                    ) -> dict[str, Any] | None:
        """The values a first call on fresh random inputs writes into ``changed``, or None
        where eager rejects those inputs. Leaves no trace: state and hooks are put back."""
        hooks = hook_keys(self.module)
        with preserved(self.module):
            assign_attributes(self.module, {k: initial.get(k, ABSENT) for k in changed})
            try:
                fresh_args, fresh_kwargs = input_sets(args, kwargs, 1)[1]
                self._probe_call(fresh_args, fresh_kwargs)
                values = _state_values(attribute_values(self.module, changed))
            except ModelError:
                values = None  # an input set eager rejects says nothing
            finally:
                remove_hooks(self.module, hook_keys(self.module) - hooks)
        return values


def _state_values(values: dict[StateKey, Any]) -> dict[str, Any]:
    """The leaves of kept Python state, tensors copied: what two first calls compare."""
    return {p: v.detach().clone() if isinstance(v, torch.Tensor) else v
            for p, v in leaves(list(values.values()), "state")}
