"""Measured costs on disk, as JSON (never pickle), shared safely between processes.

Each entry's key names what it measured: op, input shapes and dtypes, device name, thread count
and library versions, so a figure is never reused where it does not hold. A write takes an
exclusive lock, merges with what other processes wrote meanwhile, and replaces the file
atomically; a corrupt file is ignored with a warning and rebuilt.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import json
import logging
import math
import os
import tempfile
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

_FORMAT = 1


def library_versions() -> str:
    """The versions a measurement holds for: torch's kernels and autoopt's own (its lowerings
    and how it measures change between releases), read from the installed metadata (this
    layer imports nothing of the ones above it)."""
    return f"torch={torch.__version__}|autoopt={_autoopt_version()}"


@functools.cache
def _autoopt_version() -> str:
    try:
        return importlib.metadata.version("autoopt")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "source"


def _is_measurement(value: Any) -> bool:
    return type(value) in (int, float) and math.isfinite(value) and value >= 0


def _clip(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/autoopt``, else ``~/.cache/autoopt``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "autoopt"


class CostCache:
    """A JSON file of ``key -> dict`` entries, loaded once and written through.

    Args:
        path: the JSON file; its folder is created on first write.
        persistent: False keeps entries in memory only (tests, read-only homes).
    """

    def __init__(self, path: Path | str | None, persistent: bool = True) -> None:
        self.path = Path(path) if path is not None else None
        self.persistent = persistent and self.path is not None
        self._entries: dict[str, dict[str, Any]] = self._read() if self.persistent else {}
        self._garbled: set[str] = set()  # entries warned about once

    @classmethod
    def default(cls) -> CostCache:
        return cls(default_cache_dir() / "costs.json")

    @classmethod
    def in_memory(cls) -> CostCache:
        return cls(None, persistent=False)

    def get(self, key: str, numbers: Iterable[str] | None = None) -> dict[str, Any] | None:
        """The entry stored under ``key``, or None.

        ``numbers``: the fields that hold measurements (all fields but ``method`` when
        empty): an entry where one of them is not a finite number >= 0 (a damaged or
        hand-edited file: a string where seconds belong) is ignored with a warning, so that
        the caller measures again instead of failing."""
        entry = self._entries.get(key)
        if entry is None or numbers is None:
            return entry
        fields = list(numbers) or [k for k in entry if k != "method"]
        if isinstance(entry, dict) and all(_is_measurement(entry.get(k)) for k in fields
                                           if k in entry):
            return entry
        if key not in self._garbled:
            self._garbled.add(key)
            warnings.warn(f"autoopt: the cost cache's entry {_clip(key)} holds "
                          f"{_clip(entry)} where measurements belong; ignoring it, measuring "
                          f"again", stacklevel=2)
        return None

    def __len__(self) -> int:
        return len(self._entries)

    def items(self) -> list[tuple[str, dict[str, Any]]]:
        return list(self._entries.items())

    def put(self, key: str, value: dict[str, Any]) -> None:
        self.put_many({key: value})

    def put_many(self, entries: dict[str, dict[str, Any]]) -> None:
        """Store entries and write them to disk in one locked read-merge-replace."""
        self._entries.update(entries)
        if not self.persistent or not entries:
            return
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self._locked():
                merged = self._read()
                merged.update(entries)
                self._entries = {**merged, **self._entries}
                fd, tmp = tempfile.mkstemp(dir=self.path.parent, prefix=".costs-", suffix=".json")
                with os.fdopen(fd, "w") as f:
                    json.dump({"format": _FORMAT, "entries": self._entries}, f)
                os.replace(tmp, self.path)
        except OSError as exc:
            self.persistent = False
            warnings.warn(f"autoopt: cost cache {self.path} is not writable ({exc}); "
                          "measurements are kept in memory for this process only", stacklevel=3)

    def _read(self) -> dict[str, dict[str, Any]]:
        assert self.path is not None
        try:
            text = self.path.read_text()
        except (FileNotFoundError, NotADirectoryError):
            return {}
        except OSError as exc:
            warnings.warn(f"autoopt: cannot read cost cache {self.path} ({exc}); starting empty",
                          stacklevel=3)
            return {}
        try:
            data = json.loads(text)
            if data.get("format") != _FORMAT or not isinstance(data.get("entries"), dict):
                raise ValueError(f"unknown format {data.get('format')!r}")
            return data["entries"]
        except (ValueError, AttributeError) as exc:
            warnings.warn(f"autoopt: cost cache {self.path} is corrupt ({exc}); ignoring it, it "
                          "will be rebuilt", stacklevel=3)
            return {}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        assert self.path is not None
        lock_path = self.path.with_suffix(".lock")
        with open(lock_path, "a") as lock:
            try:
                import fcntl
            except ImportError:  # Windows: atomic replace still keeps the file whole
                yield
                return
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)
