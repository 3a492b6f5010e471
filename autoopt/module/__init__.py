"""The module ``optimize`` returns: the checked inputs and private copy it is built from
(``build``), calls routed to the graph of their signature (``optimized``), weights written
between calls noticed and rebuilt from (``watch``), and calls from many threads (``concurrency``).
"""

from autoopt.module.optimized import OptimizedModule, Specialization

__all__ = ["OptimizedModule", "Specialization"]
