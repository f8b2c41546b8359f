"""Skip marks for the GPU tests, shared by the test modules: each GPU test skips cleanly, with the reason, on a
machine without the accelerator."""

from __future__ import annotations

import pytest


def _jax_has_gpu() -> bool:
    import jax

    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


requires_jax_gpu = pytest.mark.skipif(not _jax_has_gpu(), reason="no GPU visible to JAX on this machine")
