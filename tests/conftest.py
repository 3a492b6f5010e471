"""Shared fixtures: small real models built from configs with random weights (nothing is
downloaded), and the GPU skip."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import HealthCheck, settings

# Hypothesis profiles for the fuzzer (tests/fuzz). ``ci``, the default, is small, deterministic
# and quick; ``long`` searches harder: ``pytest --hypothesis-profile long tests/fuzz``.
# Registered here, in the conftest pytest loads first, so the option works from any path.
_COMMON = dict(deadline=None, database=None, print_blob=True,
               suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                      HealthCheck.filter_too_much])
settings.register_profile("ci", max_examples=180, derandomize=True, **_COMMON)
settings.register_profile("long", max_examples=2000, **_COMMON)
settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; torch.cuda.is_available() is False here "
                                   "(run bench/gpu_check.py on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One intra-op thread for the test, restored after it (tests that time real runs)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True, scope="session")
def _aten_backend_by_default() -> Iterator[None]:
    """Tests not about backends run on ``aten`` alone: compiling every test's graphs with
    Inductor and ONNX Runtime would take hours on 2 cores. ``tests/test_backends.py`` names
    its backends; ``AUTOOPT_BACKENDS=aten,inductor,onnxruntime pytest`` runs the whole suite
    with every backend in the choice."""
    mp = pytest.MonkeyPatch()
    if "AUTOOPT_BACKENDS" not in os.environ:
        mp.setenv("AUTOOPT_BACKENDS", "aten")
    # Progress lines take autoopt's log records for a long call, which tests read through
    # caplog; tests/test_progress.py turns them on.
    mp.setenv("AUTOOPT_PROGRESS", "0")
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _measurements_on_a_quiet_machine() -> Iterator[None]:
    """Choices are measured as on a quiet machine: a choice measured while other processes
    held the cores is marked and measured again at every later optimize, so tests of what a
    later optimize reads from the cache would depend on the machine's load (CI's runners and
    a developer's laptop are often shared). tests/test_contention.py and
    tests/test_size_reuse.py simulate the load they test; ``AUTOOPT_TEST_REAL_LOAD=1`` reads
    the machine's own."""
    if os.environ.get("AUTOOPT_TEST_REAL_LOAD") == "1":
        yield
        return
    from checks import simulated_watch

    from autoopt.cost_model import model as model_module

    mp = pytest.MonkeyPatch()
    mp.setattr(model_module, "Watch", simulated_watch(0.0))
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _choices_measured_not_predicted() -> Iterator[None]:
    """Each test's backend choice is measured among all its candidates, not predicted from a
    similar graph an earlier test measured into the session's cache: which tests ran before
    one must not change what it measures. tests/test_prediction.py turns prediction on."""
    from autoopt.backends import prediction

    mp = pytest.MonkeyPatch()
    mp.setattr(prediction, "ENABLED", False)
    yield
    mp.undo()


@pytest.fixture(autouse=True, scope="session")
def _private_cost_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Tests measure into their own cost cache, never the user's ~/.cache/autoopt."""
    mp = pytest.MonkeyPatch()
    mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg-cache")))
    yield
    mp.undo()
