"""Single source of the package version (read by pyproject.toml)."""

__version__ = "0.2.0"
