"""Whole-graph decisions that are not rewrites: what to keep, offload or recompute under a
memory budget (``activations`` lists what the graph saves, ``segments`` prices a choice of modes,
``memory_plan`` searches)."""
