"""Test configuration: Hypothesis profiles and shared helpers.

Profiles (select with the environment variable ``OTB_HYPOTHESIS_PROFILE``; default ``ci``):

* ``ci``       — derandomized (the same examples every run), 50 examples per property, no deadline. CI uses it.
* ``dev``      — random seeds, 60 examples: finds new counterexamples during development.
* ``thorough`` — random seeds, 2000 examples per property: for hand runs before a release.

Tests marked ``slow`` (large Monte Carlo runs) are skipped unless ``--run-slow`` is given. Tests marked ``bitexact``
assert bit-for-bit equality; ``.ci/run`` runs them a second time with NumPy's SIMD dispatch limited to its baseline
(``NPY_DISABLE_CPU_FEATURES``) and ``OTB_TORCH_THREADS=1`` (``torch.set_num_threads`` before any test), so that bits
depending on the CPU's features or on the thread count fail in CI (docs/vectors.md, "What is promised bit for bit").

The README's test command runs the files in parallel (pytest-xdist, ``-n auto --dist loadfile``: each file stays in one
worker, so a module's fixtures are built once): as many workers as CPUs this process may run on, at most
``MAX_WORKERS`` (:func:`pytest_xdist_auto_num_workers`). ``-n 0`` runs everything in one process.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

_COMMON = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("ci", derandomize=True, database=None, max_examples=50, **_COMMON)
settings.register_profile("dev", max_examples=60, **_COMMON)
settings.register_profile("thorough", max_examples=2000, **_COMMON)
settings.load_profile(os.environ.get("OTB_HYPOTHESIS_PROFILE", "ci"))

# JAX's distributed tests (tests/test_jax_distributed.py) shard over several host devices; the flag must be set before
# JAX starts its CPU backend. Single-device code is unaffected: arrays live on the first device.
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4").strip()

if os.environ.get("OTB_TORCH_THREADS"):
    try:
        import torch
    except ImportError:
        pass
    else:
        torch.set_num_threads(int(os.environ["OTB_TORCH_THREADS"]))


# Each worker imports torch, JAX, verl and transformers (about 1–2 GB) and some tests start processes of their own: a
# handful of workers already splits the suite's largest files apart (tests/test_adapters.py alone is a quarter of it).
MAX_WORKERS = 4


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: the CPUs this process may run on (its affinity, not the host's count, which a container or a
    hyperthreaded VM overstates for this purpose), at most :data:`MAX_WORKERS`."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:                       # macOS, Windows
        usable = os.cpu_count() or 1
    return max(1, min(MAX_WORKERS, usable))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", default=False, help="also run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _leave_generated_properties_to_the_fast_twin(items)
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow profile: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def _leave_generated_properties_to_the_fast_twin(items: list[pytest.Item]) -> None:
    """tests/test_adapters.py: on an adapter listed in its FIXED_CASES_ONLY (and not selected by OTB_ADAPTERS), skip
    the Hypothesis properties, which its twin runs on the same port."""
    for item in items:
        module = getattr(item, "module", None)
        twins = getattr(module, "FIXED_CASES_ONLY", None)
        callspec = getattr(item, "callspec", None)
        if not twins or callspec is None:
            continue
        name = callspec.params.get("adapter")
        if name in twins and name not in module.SELECTED and getattr(item.function, "is_hypothesis_test", False):
            item.add_marker(pytest.mark.skip(
                reason=f"{name}: generated properties run on {twins[name]} (the same port, traced); its fixed cases "
                       f"run here (OTB_ADAPTERS={name} runs everything on it)"))
