"""Decisions over a whole graph that are not rewrites: where to cut pipeline stages
(``partition``) and what to keep, offload or recompute under a memory budget (``activations``
lists what the graph saves, ``segments`` prices a choice of modes, ``memory_plan`` searches)."""
