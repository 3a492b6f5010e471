"""From a model and inputs to a verified graph: capture one signature (``specialize``), run the
passes with verification and rollback (``pass_runner``), the guards a graph assumes (``guards``),
and the same work for graphs torch.compile hands over (``dynamo``)."""
