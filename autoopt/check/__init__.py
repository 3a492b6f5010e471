"""Whether an optimized graph computes the model's function: outputs compared against eager
within a tolerance (``compare``) on the example and fresh random inputs (``inputs``), the module
state a call may write and what it restores (``state``), and the record of what was captured,
rewritten, verified and rolled back (``report``).
"""
