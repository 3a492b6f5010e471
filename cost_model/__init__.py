"""How long each node takes and how much memory it holds on the target device.

The cost model is the one place in autoopt that measures. Passes read it through
``PassContext.cost``; until it is built (issue 3) that field is None and passes that need it
must not fire.
"""
