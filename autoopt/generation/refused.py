"""Step graphs refused after ``generate`` has served a call: those steps run eagerly.

A step graph is built on the first call that needs it: the prompt step's on the second call
(the first call's prompt step allocates the cache, eagerly), a decode step's on the first call
with a new batch size or cache length. Verification may refuse one where those built before
were accepted (``precision="int8"``: the prompt graph errs past the tolerance on fresh inputs).
Raising then would turn a ``generate`` loop that worked into an exception at its second call;
instead that step runs the model as it is, eagerly (in fp32), in this call and the later ones,
and the reason is in ``generation_stats.note`` and ``report.warnings``. Before any call was
served a refusal raises, as ``optimize`` does for its example: the precision asked for applies
to the decoding or the first call says why not.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any

from autoopt.errors import ConfigError


class Refusals:
    """The step graphs refused after a call was served, by step key, with why."""

    def __init__(self) -> None:
        # Whether a generate call has completed through the step graphs: from then on a
        # refused graph is a step run eagerly, not an error.
        self.served = False
        self.reasons: dict[Hashable, str] = {}

    def build(self, key: Hashable, what: str, make: Callable[[], Any]) -> Any | None:
        """``make()`` (the step module for ``key``, ``what`` step it is), or None where its
        graph was refused, now or on an earlier call (``reasons[key]`` says why)."""
        if key in self.reasons:
            return None
        try:
            return make()
        except ConfigError as exc:
            if not self.served:
                raise
            self.reasons[key] = (f"the {what} step ran eagerly: its graph was refused "
                                 f"({exc})")
            return None

    def note(self, key: Hashable, note: str) -> str:
        """``note`` (the call's stats note) with why ``key``'s step ran eagerly, once."""
        reason = self.reasons[key]
        return note if reason in note else "; ".join(filter(None, (note, reason)))
