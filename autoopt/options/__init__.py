"""What the user asked for, parsed once and checked with a clear error: ``OptimizeConfig``
(``config``), the precision and its tolerance (``precision``), and the memory budget and modes
(``memory``). Nothing here imports torch's compilers or a backend."""
