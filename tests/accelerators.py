"""Skip marks for the GPU tests, shared by the test modules: each GPU test skips cleanly, with the reason, on a
machine without the accelerator.

Each mark is made on first import of its name (``from accelerators import requires_cuda``), so that a torch test
module does not import JAX, nor a JAX one torch."""

from __future__ import annotations

import functools

import pytest

__all__ = ["requires_cuda", "requires_jax_gpu"]


def _torch_has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _jax_has_gpu() -> bool:
    try:
        import jax
    except ImportError:
        return False
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


_MARKS = {"requires_cuda": (_torch_has_cuda, "no CUDA device visible to torch on this machine"),
          "requires_jax_gpu": (_jax_has_gpu, "no GPU visible to JAX on this machine")}


@functools.cache
def __getattr__(name: str) -> pytest.MarkDecorator:
    if name not in _MARKS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    present, reason = _MARKS[name]
    return pytest.mark.skipif(not present(), reason=reason)
