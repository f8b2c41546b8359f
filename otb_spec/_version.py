"""Single source of the package version (read by pyproject.toml)."""

__version__ = "0.1.0"
