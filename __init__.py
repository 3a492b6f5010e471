"""Not a package: the root of autoopt's repository (the package is ``autoopt/`` inside it).

Run from the folder that holds a clone named ``autoopt``, ``import autoopt`` finds the clone
before the installed package (the current folder comes first on ``sys.path``) and, without this
file, imports it as an empty namespace package: ``module 'autoopt' has no attribute
'optimize'``. With it, that import fails and says why. setuptools ignores this file (the
packages are listed in pyproject.toml).
"""

import importlib
import sys
from pathlib import Path

_ROOT = Path(__file__).absolute().parent
# The folder holding the clone, as sys.path names it (a symlinked clone resolves elsewhere).
_PARENT = _ROOT.parent.resolve()


def _found_through_sys_path() -> bool:
    return any(Path(entry or ".").resolve() == _PARENT for entry in sys.path)


if __name__ == "autoopt" and _found_through_sys_path():
    _where = ("the current folder" if _PARENT == Path.cwd().resolve()
              else f"{_PARENT}, which is on sys.path,")
    raise ImportError(
        f"'import autoopt' found {_ROOT}, the autoopt repository, instead of the package "
        f"inside it ({_ROOT / 'autoopt'}): Python looked in {_where} before the installed "
        f"package. Run from inside the repository, or from another folder after "
        f"`pip install -e {_ROOT}`.")
if __name__ == "autoopt":
    # Imported by path, not through sys.path: pytest reads a rootdir __init__.py as a package
    # named after the folder. Leave the real package behind that name, or every later
    # `import autoopt` in the tests would get this file.
    del sys.modules[__name__]
    sys.modules[__name__] = importlib.import_module(__name__)
