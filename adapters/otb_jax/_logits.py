"""Σπ², log π(y) and entropy from logits in JAX; vocab-shard partials. Float32 accumulation for half precision.

``sum_pi_squared(logits, vocab_chunk=C)`` streams the vocabulary in chunks of C with a ``lax.scan`` that keeps the
running (max, Σexp, Σexp²), rescaling them when the maximum grows — the online form of the reference's S₂/S₁², with
temporaries of [..., C] instead of [..., V].
"""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from otb_jax import _checks as check
from otb_spec import _validation as reference_checks

__all__ = ["sum_pi_squared", "TokenStatistics", "token_statistics_from_logits", "ShardPartials",
           "vocab_shard_partials", "combine_vocab_shards"]


def _logits(name: str, logits: Any, check_values: bool, allow_excluded_rows: bool = False) -> jax.Array:
    z = check.array(name, logits)
    if z.ndim < 1:
        raise ValueError(f"{name}: expected shape [..., V] with a vocabulary axis, got a scalar")
    if z.shape[-1] == 0:
        raise ValueError(f"{name}: the vocabulary axis is empty (V = 0)")
    if check_values and not check.is_traced(z):
        bad = jnp.any(jnp.isnan(z)) | jnp.any(z == jnp.inf)
        if not allow_excluded_rows:
            bad = bad | jnp.any(jnp.all(z == -jnp.inf, axis=-1))
        if check.concrete_flag(bad):
            host = reference_checks.float_array(name, check._host(z), allow_neg_inf=True)
            excluded = np.all(host == -np.inf, axis=-1)
            first = tuple(int(i) for i in np.argwhere(excluded)[0])
            raise ValueError(f"{name}: every logit is -inf at position {first}; the softmax is undefined there")
    return z


def _dtypes(z: jax.Array) -> tuple[Any, Any]:
    compute = jnp.float64 if z.dtype == jnp.float64 else jnp.float32
    out = z.dtype if jnp.issubdtype(z.dtype, jnp.floating) else jnp.float32
    return compute, out


@partial(jax.jit, static_argnames=("vocab_chunk",))
def _sum_pi_squared(z: jax.Array, vocab_chunk: int | None) -> jax.Array:
    compute, out = _dtypes(z)
    z = z.astype(compute)
    vocab = z.shape[-1]
    if vocab_chunk is None or vocab_chunk >= vocab:
        peak = jnp.max(z, axis=-1, keepdims=True)
        a = jnp.exp(z - peak)
        return (jnp.sum(a * a, axis=-1) / jnp.square(jnp.sum(a, axis=-1))).astype(out)
    chunks = -(-vocab // vocab_chunk)
    padded = jnp.pad(z, [(0, 0)] * (z.ndim - 1) + [(0, chunks * vocab_chunk - vocab)], constant_values=-jnp.inf)
    blocks = jnp.moveaxis(padded.reshape(z.shape[:-1] + (chunks, vocab_chunk)), -2, 0)

    def step(carry, block):
        peak, s1, s2 = carry
        new_peak = jnp.maximum(peak, jnp.max(block, axis=-1))
        shift = jnp.where(jnp.isfinite(new_peak), new_peak, 0)
        scale = jnp.exp(peak - shift)
        a = jnp.exp(block - shift[..., None])
        return (new_peak, s1 * scale + jnp.sum(a, axis=-1), s2 * scale * scale + jnp.sum(a * a, axis=-1)), None

    initial = (jnp.full(z.shape[:-1], -jnp.inf, compute), jnp.zeros(z.shape[:-1], compute),
               jnp.zeros(z.shape[:-1], compute))
    (_, s1, s2), _ = jax.lax.scan(step, initial, blocks)
    return (s2 / jnp.square(s1)).astype(out)


def sum_pi_squared(logits: Any, *, vocab_chunk: int | None = None, check_values: bool = True) -> jax.Array:
    """Σπ² = Σ_v softmax(z)_v² per position: [..., V] → [...] in the logits' dtype (float32/float64 accumulation).

    Args:
      logits: [..., V] (bf16/fp16 accepted; −inf allowed for excluded tokens).
      vocab_chunk: stream the vocabulary in chunks of this size (online log-sum-exp) — bounded temporaries.
      check_values: reject NaN, +inf and all −inf rows (for concrete arrays).
    """
    if vocab_chunk is not None and (isinstance(vocab_chunk, bool) or not isinstance(vocab_chunk, (int, np.integer))
                                    or vocab_chunk < 1):
        raise ValueError(f"vocab_chunk: expected a positive integer or None, got {vocab_chunk!r}")
    return _sum_pi_squared(_logits("logits", logits, check_values), None if vocab_chunk is None else int(vocab_chunk))


class TokenStatistics(NamedTuple):
    """log π(y) (None without token ids), entropy and Σπ², each [...] in the logits' dtype."""

    log_probs: jax.Array | None
    entropy: jax.Array
    sum_pi_squared: jax.Array


@jax.jit
def _statistics(z: jax.Array, ids: jax.Array | None):
    compute, out = _dtypes(z)
    z = z.astype(compute)
    peak = jnp.max(z, axis=-1, keepdims=True)
    shifted = z - peak
    a = jnp.exp(shifted)
    total = jnp.sum(a, axis=-1)
    log_total = jnp.log(total)
    spp = jnp.sum(a * a, axis=-1) / jnp.square(total)
    entropy = log_total - jnp.sum(a * jnp.where(jnp.isinf(shifted), 0, shifted), axis=-1) / total
    log_probs = None
    if ids is not None:       # ids outside [0, V) (traced, or unchecked): NaN — a negative one would wrap around
        in_range = (ids >= 0) & (ids < z.shape[-1])
        chosen = jnp.take_along_axis(shifted, jnp.clip(ids, 0, z.shape[-1] - 1)[..., None], axis=-1)[..., 0]
        log_probs = jnp.where(in_range, chosen - log_total, jnp.nan).astype(out)
    return log_probs, entropy.astype(out), spp.astype(out)


def token_statistics_from_logits(logits: Any, token_ids: Any = None, *, check_values: bool = True) -> TokenStatistics:
    """log π(y), entropy and Σπ² in one pass; the port of :func:`otb_spec.token_statistics_from_logits`. Token ids
    outside [0, V) raise for concrete arrays (``check_values``); traced ones, or unchecked, give log π = NaN there."""
    z = _logits("logits", logits, check_values)
    ids = None
    if token_ids is not None:
        ids = check.token_ids(token_ids, tuple(z.shape[:-1]), "logits", "vocabulary")
        if check_values and not check.is_traced(ids):
            host = np.asarray(ids)
            bad = (host < 0) | (host >= z.shape[-1])
            if bad.any():
                first = tuple(int(i) for i in np.argwhere(bad)[0])
                raise ValueError(f"token_ids: must lie in [0, {z.shape[-1]}) (the vocabulary), found {int(host[first])} "
                                 f"at index {first}")
    return TokenStatistics(*_statistics(z, ids))


class ShardPartials(NamedTuple):
    """(max, Σexp, Σexp²) of a vocabulary shard per position."""

    max_logit: jax.Array
    sum_exp: jax.Array
    sum_exp_squared: jax.Array

    @property
    def logsumexp(self) -> jax.Array:
        return self.max_logit + jnp.log(self.sum_exp)

    @property
    def sum_pi_squared(self) -> jax.Array:
        return self.sum_exp_squared / jnp.square(self.sum_exp)


def vocab_shard_partials(logits_shard: Any, *, check_values: bool = True) -> ShardPartials:
    """Partials of one shard (identity (−inf, 0, 0) where the shard is all −inf)."""
    z = _logits("logits_shard", logits_shard, check_values, allow_excluded_rows=True)
    compute, _ = _dtypes(z)
    z = z.astype(compute)
    peak = jnp.max(z, axis=-1)
    shift = jnp.where(jnp.isfinite(peak), peak, 0)
    a = jnp.exp(z - shift[..., None])
    return ShardPartials(peak, jnp.sum(a, axis=-1), jnp.sum(a * a, axis=-1))


def combine_vocab_shards(partials: Sequence[ShardPartials]) -> ShardPartials:
    """Merge disjoint shards (associative, commutative): M = maxₖ mₖ, S₁ = Σ S₁ₖe^{mₖ−M}, S₂ = Σ S₂ₖe^{2(mₖ−M)}."""
    items = list(partials)
    if not items:
        raise ValueError("partials: need at least one shard")
    maxima = jnp.stack([item.max_logit for item in items])
    overall = jnp.max(maxima, axis=0)
    scale = jnp.exp(maxima - jnp.where(jnp.isfinite(overall), overall, 0))
    return ShardPartials(overall, jnp.sum(jnp.stack([item.sum_exp for item in items]) * scale, axis=0),
                         jnp.sum(jnp.stack([item.sum_exp_squared for item in items]) * scale * scale, axis=0))

