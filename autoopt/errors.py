"""Errors autoopt raises for bad input. Each message names what is wrong and what to do."""

from __future__ import annotations

import importlib
import re
from types import ModuleType


class AutoOptError(Exception):
    """Base class of every error autoopt raises on purpose."""


class ModelError(AutoOptError, TypeError):
    """The model is not something autoopt can optimize (not a module, fails in eager, ...)."""


class InputError(AutoOptError, ValueError):
    """The example inputs do not fit the model (wrong container, dtype or device)."""


class ArgumentError(InputError, TypeError):
    """A call's arguments do not bind to the inputs: one given twice, too many, missing.

    A ``TypeError``, as Python's own for such a call, and an ``InputError``.
    """


class ConfigError(AutoOptError, ValueError):
    """An option passed to ``optimize`` is unknown or has an impossible value."""


class DeviceError(AutoOptError, RuntimeError):
    """The requested device is not present on this machine."""


class ModelSpecError(AutoOptError, ValueError):
    """A command-line MODEL spec could not be resolved to an ``nn.Module``."""


class DependencyError(AutoOptError, ImportError):
    """A package that a feature needs is not installed."""


def wrapped_error(exc: BaseException, kind: type[AutoOptError] = AutoOptError,
                  ) -> AutoOptError | None:
    """The ``kind`` of autoopt error inside ``exc``, if one is: raised on purpose (a
    ``ConfigError`` for a feature that cannot apply), it must reach the user, and Dynamo
    wraps what a backend raises (``BackendCompilerFailed``, ``inner_exception``)."""
    current: BaseException | None = exc
    for _ in range(8):
        if current is None:
            return None
        if isinstance(current, kind):
            return current
        current = getattr(current, "inner_exception", None) or current.__cause__
    return None


def require(module: str, feature: str, install: str) -> ModuleType:
    """Import ``module`` for ``feature``, or say what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise DependencyError(f"{feature} needs the {module!r} package, which is not installed "
                              f"({exc}); install it with `{install}`.") from exc


def first_line(exc: BaseException, limit: int = 300) -> str:
    """The first non-empty line of ``exc``, without terminal colour codes, cut at a word."""
    text = ANSI.sub("", str(exc)).strip()
    line = next((line.strip() for line in text.splitlines() if line.strip()), "")
    if len(line) <= limit:
        return line
    return line[:limit].rsplit(" ", 1)[0] + " ..."


ANSI = re.compile(r"\x1b\[[0-9;]*m")
