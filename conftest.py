"""Collection of the package's doctests (``--doctest-modules`` over otb_spec/): modules that need an optional
framework are left out when it is not installed."""

import importlib.util

import pytest

collect_ignore = []
if importlib.util.find_spec("torch") is None:
    collect_ignore.append("otb_spec/conformance/mutants.py")

# pytester runs the pytest plugin's own tests (tests/test_pytest_plugin.py) in fresh pytest processes
pytest_plugins = ["pytester"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Doctests print exact numbers: they are bit-exact checks (marker ``bitexact``, repeated by .ci/run's second
    pass at baseline SIMD and one thread)."""
    for item in items:
        if isinstance(item, pytest.DoctestItem):
            item.add_marker(pytest.mark.bitexact)
