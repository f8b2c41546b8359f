"""The JAX port's adapter for the conformance suite (``otb_spec.adapters``): conversion + dispatch.

``jit=False`` runs everything under ``jax.disable_jit()`` (op by op). Calls with float64 inputs run under
``jax.enable_x64(True)``; float32 and half-precision inputs run with the process's default (x64 off).

Like a JAX trainer, the adapter pads to shape buckets (powers of two, at least 8) so that a suite drawing many shapes
does not recompile for each: padding rows are empty and each forms its own group (they change nothing for the real
rows), padding positions are masked at the end of every row, ``num_segments`` is the padded row count (empty segments
contribute nothing), and padding vocabulary entries are −inf (probability exactly 0). Outputs are cropped back.
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import otb_jax

__all__ = ["JaxAdapter", "make_adapter"]


class JaxAdapter:
    def __init__(self, platform: str = "cpu", jit: bool = True):
        self.device_object = jax.devices(platform)[0]
        self.device = str(self.device_object)
        self.jit = bool(jit)
        self.name = f"jax-{platform}" + ("" if jit else "-nojit")

    def _context(self, *arrays: Any):
        stack = contextlib.ExitStack()
        wide = any(getattr(a, "dtype", None) == jnp.float64 for a in arrays if a is not None)
        stack.enter_context(jax.enable_x64(wide))
        if not self.jit:
            stack.enter_context(jax.disable_jit())
        return stack

    def asarray(self, array: Any, dtype: str) -> jax.Array:
        host = np.asarray(array)
        with jax.enable_x64(dtype == "float64"):
            if dtype == "bfloat16":
                return jax.device_put(jnp.asarray(host.astype(np.float32)).astype(jnp.bfloat16), self.device_object)
            return jax.device_put(jnp.asarray(host.astype(dtype)), self.device_object)

    def to_numpy(self, array: jax.Array) -> np.ndarray:
        host = np.asarray(array)
        return host.astype(np.float32) if host.dtype.name in ("bfloat16", "float16") else host

    def segments(self, group_ids: Any) -> tuple[np.ndarray, int]:
        return otb_jax.segment_ids(group_ids)

    def compute_dtype(self, input_dtype: str) -> str:
        return "float64" if input_dtype == "float64" else "float32"

    def _otb(self, function, rewards, response_mask, segments, log_probs, sum_pi_squared, **options):
        ids, _ = segments
        rows, positions = rewards.shape
        padded_rows, padded_positions = _bucket(rows), _bucket(positions)
        pad = [(0, padded_rows - rows), (0, padded_positions - positions)]
        padded_ids = np.concatenate([ids, np.arange(int(ids.max()) + 1, int(ids.max()) + 1 + padded_rows - rows)])
        weights = options.pop("is_weights", None)
        with self._context(rewards, log_probs, sum_pi_squared, weights):
            arrays = [jnp.pad(a, pad) for a in (rewards, response_mask, log_probs, sum_pi_squared)]
            if weights is not None:
                weights = jnp.pad(weights, pad)
            result = function(arrays[0], arrays[1], jax.device_put(padded_ids.astype(np.int32), self.device_object),
                              padded_rows, arrays[2], arrays[3], is_weights=weights, **options)
            return result.advantages[:rows, :positions], result.returns[:rows, :positions]

    def optimal_token_baseline(self, rewards, response_mask, segments, log_probs, sum_pi_squared, *,
                               is_weights=None, handle_zero_tail=True, epsilon=1e-8):
        return self._otb(otb_jax.optimal_token_baseline, rewards, response_mask, segments, log_probs, sum_pi_squared,
                         is_weights=is_weights, handle_zero_tail=handle_zero_tail, epsilon=epsilon)

    def multi_turn_optimal_token_baseline(self, rewards, response_mask, segments, log_probs, sum_pi_squared, *,
                                          is_weights=None, handle_zero_tail=True, epsilon=1e-8):
        return self._otb(otb_jax.multi_turn_optimal_token_baseline, rewards, response_mask, segments, log_probs,
                         sum_pi_squared, is_weights=is_weights, handle_zero_tail=handle_zero_tail, epsilon=epsilon)

    def leave_one_out_token_baseline(self, rewards, response_mask, segments, log_probs, sum_pi_squared, *,
                                     is_weights=None, align="position", epsilon=1e-8):
        return self._otb(otb_jax.leave_one_out_token_baseline, rewards, response_mask, segments, log_probs,
                         sum_pi_squared, is_weights=is_weights, align=align, epsilon=epsilon)

    def sum_pi_squared(self, logits: jax.Array) -> jax.Array:
        with self._context(logits):
            return otb_jax.sum_pi_squared(_pad_vocabulary(logits))

    def token_statistics_from_logits(self, logits: jax.Array, token_ids: jax.Array):
        with self._context(logits):
            return tuple(otb_jax.token_statistics_from_logits(_pad_vocabulary(logits), token_ids))


def _bucket(size: int) -> int:
    return max(8, 1 << (int(size) - 1).bit_length())


def _pad_vocabulary(logits: jax.Array) -> jax.Array:
    vocab = logits.shape[-1]
    return jnp.pad(logits, [(0, 0)] * (logits.ndim - 1) + [(0, _bucket(vocab) - vocab)], constant_values=-jnp.inf)


def make_adapter(platform: str = "cpu", jit: bool = True) -> JaxAdapter:
    return JaxAdapter(platform=platform, jit=jit)
