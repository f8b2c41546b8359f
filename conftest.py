"""Collection of the package's doctests (``--doctest-modules`` over otb_spec/): modules that need an optional
framework are left out when it is not installed."""

import importlib.util

collect_ignore = []
if importlib.util.find_spec("torch") is None:
    collect_ignore.append("otb_spec/conformance/mutants.py")

# pytester runs the pytest plugin's own tests (tests/test_pytest_plugin.py) in fresh pytest processes
pytest_plugins = ["pytester"]
