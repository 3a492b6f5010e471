"""The orders a pipeline runs its stages' forwards and backwards in over microbatches (GPipe,
1F1B), each a list of actions that respects every dependency between them."""

from __future__ import annotations

Action = tuple[str, int, int]  # ("F" or "B", stage, microbatch)


def gpipe_order(stages: int, microbatches: int, backward: bool = True) -> list[Action]:
    """All forwards by clock tick (stage s runs microbatch t - s at tick t), then all
    backwards in the mirror order."""
    forward = [("F", s, t - s) for t in range(microbatches + stages - 1)
               for s in range(stages) if 0 <= t - s < microbatches]
    if not backward:
        return forward
    back = [("B", s, t - (stages - 1 - s)) for t in range(microbatches + stages - 1)
            for s in reversed(range(stages)) if 0 <= t - (stages - 1 - s) < microbatches]
    return forward + back


def one_f_one_b_order(stages: int, microbatches: int) -> list[Action]:
    """1F1B: stage s runs ``stages - s - 1`` warm-up forwards, then alternates one forward and
    one backward, then drains its backwards; at most ``stages - s`` microbatches' activations
    are alive on it at once. Returned as one sequence that respects every dependency."""
    per_stage: list[list[Action]] = []
    for s in range(stages):
        warm = min(stages - s - 1, microbatches)
        actions: list[Action] = [("F", s, m) for m in range(warm)]
        f, b = warm, 0
        while f < microbatches:
            actions += [("F", s, f), ("B", s, b)]
            f, b = f + 1, b + 1
        actions += [("B", s, m) for m in range(b, microbatches)]
        per_stage.append(actions)
    done: set[Action] = set()
    order: list[Action] = []
    cursor = [0] * stages
    while len(order) < stages * microbatches * 2:
        progressed = False
        for s in range(stages):
            if cursor[s] == len(per_stage[s]):
                continue
            kind, _, m = action = per_stage[s][cursor[s]]
            ready = (("F", s - 1, m) in done or s == 0) if kind == "F" else \
                (("B", s + 1, m) in done or s == stages - 1) and ("F", s, m) in done
            if ready:
                order.append(action)
                done.add(action)
                cursor[s] += 1
                progressed = True
        if not progressed:  # every stage's next step waits on another: a bug in the lists
            raise AssertionError(f"1F1B order deadlocked after {order}")
    return order
