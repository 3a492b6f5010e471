"""Capture: a model and example inputs into FX graphs with shape and dtype on every node.

``graph``: whole graphs by ``torch.export`` or ``torch.fx.symbolic_trace``, and the fake-tensor
metadata every node carries. ``dynamo``: autoopt as a ``torch.compile`` backend, each Dynamo
subgraph optimized and the rest eager.
"""

from autoopt.capture.graph import annotate, export_graph, flat_example_inputs, symbolic_trace_graph

__all__ = ["annotate", "export_graph", "flat_example_inputs", "symbolic_trace_graph"]
