"""log π(y), entropy and Σπ² from hidden states and the LM head in JAX, never materialising the logits; the port of
:func:`otb_spec.token_statistics_from_hidden`, with a custom VJP for log π and the entropy.

For hidden [..., H] (N tokens), weight [V, H] and ids [...], z = h·Wᵀ/τ. The tokens are padded to a multiple of
``chunk_size`` rows; a ``lax.scan`` walks the row chunks and, inside each, a second ``lax.scan`` walks the vocabulary
in chunks of ``vocab_chunk_size`` columns. Each block z[rows, columns] is one ``dot_general`` (accumulated in float32
for bfloat16/float16 inputs, float64 for float64) folded into running per-token sums, rescaled when the maximum
grows (online log-sum-exp):

    m = max z,   S₁ = Σ e^{z−m},   S₂ = Σ e^{2(z−m)},   T = Σ e^{z−m}(z − m),   z_y

    log π(y) = z_y − m − log S₁,   H = log S₁ − T/S₁,   Σπ² = S₂/S₁²

Matmul precision: the port sets none of its own — its ``dot_general`` calls follow the caller's
``jax_default_matmul_precision``, as the model's own logits matmul does. JAX's default lets float32 products run in
TF32 on recent NVIDIA GPUs (a 10-bit mantissa), which the float32 error bounds do not cover; under
``jax.default_matmul_precision("float32")`` the statistics and gradients meet them (tests/test_jax_fused.py, run on
an H200).

When V is not a multiple of the vocabulary chunk, the last chunk is the final ``vocab_chunk_size`` columns of W
(a clamped ``dynamic_slice``, no padded copy of W) with the columns an earlier chunk already covered masked out.

The backward pass (``jax.custom_vjp``) keeps lse = m + log S₁ and H per token and rebuilds each block:

    log π_v = z_v − lse,   ∂z = g_lp·(e_y − π) − g_H·π ⊙ (log π + H)
    ∂h += ∂z·W_chunk/τ,   ∂W_chunk += ∂zᵀ·h/τ,   ∂τ += −Σ ∂z ⊙ z/τ

so τ may be a traced value and still gets its exact gradient. Σπ² gets no gradient (its cotangent is ignored:
``stop_gradient`` semantics; OTB uses it as a constant).

Peak extra memory (beyond inputs and outputs): forward — the padded hidden states ([N_pad, H], a copy of hidden when N
is not a multiple of the chunk), about three [rows, columns] blocks in the compute dtype (2²² values per block on CPU,
2²⁶ on GPU/TPU, by default and also with ``chunk_size`` set unless it exceeds budget/1024 rows: 16 MiB each in float32
on CPU; with both chunk sizes set, chunk_size × vocab_chunk_size), a [columns, H] slice of W (in float32 for
half-precision weights, at most 2²⁴ values = 64 MiB) and a few floats per token (the value check is one compiled
reduction per input, with no temporary of the inputs' size); backward — the same blocks, plus float32 (float64)
accumulators for ∂W [V, H] and ∂h [N_pad, H], which become the returned gradients (cast to the inputs' dtypes: for
bfloat16/float16 inputs the float32 accumulators are twice their size). Nothing grows with N·V: no [N, V] array exists
in the forward or the backward pass (tests/test_jax_fused.py inspects the traced program).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from otb_jax import _checks as check
from otb_jax._logits import TokenStatistics
from otb_spec import _validation as reference_checks
from otb_spec.lm_head import _logits_may_overflow, checked_temperature

__all__ = ["fused_linear_token_statistics"]

_BLOCK_ELEMENTS = {"cpu": 2**22, "gpu": 2**26, "tpu": 2**26}   # values per [rows, columns] block
_WEIGHT_CHUNK_ELEMENTS = 2**24                                  # float32 copy of a chunk of half-precision W


def _positive_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")
    return int(value)


def _temperature(value: Any, compute: Any) -> jax.Array:
    """τ as a scalar of the compute dtype, by the reference's rule (otb_spec.lm_head.checked_temperature) unless
    traced."""
    if isinstance(value, jax.Array):
        if value.size != 1:
            raise ValueError(f"temperature: expected a scalar, got shape {tuple(value.shape)}")
        if value.dtype == jnp.bool_:
            raise TypeError("temperature: expected a real number, got a bool")
        if not jnp.issubdtype(value.dtype, jnp.floating) and not jnp.issubdtype(value.dtype, jnp.integer):
            raise TypeError(f"temperature: expected a real number, got dtype {value.dtype}")
        tau = value.reshape(())
        if not check.is_traced(tau):
            _finite_reciprocal(checked_temperature(float(tau)), compute)
        return tau.astype(compute)
    return jnp.asarray(_finite_reciprocal(checked_temperature(value), compute), dtype=compute)


def _finite_reciprocal(temperature: float, compute: Any) -> float:
    """τ, which the blocks divide by in the compute dtype: at least its smallest normal number (XLA flushes subnormals
    to 0, and 1/τ is then finite)."""
    if temperature < float(jnp.finfo(compute).tiny):
        raise ValueError(f"temperature: τ = {temperature!r} is too small for {np.dtype(compute).name} logits (below "
                         f"its smallest normal number, {float(jnp.finfo(compute).tiny):.3g}: flushed to 0)")
    return temperature


def _blocks(n_rows: int, vocab: int, n_hidden: int, half_weight: bool, chunk_size: int | None,
            vocab_chunk_size: int | None) -> tuple[int, int]:
    """(rows, columns) per block: columns = V unless a float32 copy of W's chunk or the block would be too large —
    with ``chunk_size`` rows given, at most max(1024, budget // chunk_size) columns, so that the block stays within
    the budget (as otb_torch sizes it) instead of becoming chunk_size × V."""
    budget = _BLOCK_ELEMENTS.get(jax.default_backend(), _BLOCK_ELEMENTS["cpu"])
    if vocab_chunk_size is None:
        columns = vocab
        if half_weight:
            columns = min(columns, max(1, _WEIGHT_CHUNK_ELEMENTS // n_hidden))
        rows_hint = 16 if chunk_size is None else min(chunk_size, max(n_rows, 1))
        columns = min(columns, max(1024, budget // rows_hint))
    else:
        columns = min(vocab_chunk_size, vocab)
    rows = chunk_size if chunk_size is not None else max(1, budget // columns)
    return max(1, min(rows, n_rows)), columns


def _dot(a: jax.Array, b: jax.Array, compute: Any, contract: tuple[int, int]) -> jax.Array:
    """a·b contracting axis contract[0] of a with contract[1] of b, accumulated in ``compute``."""
    if a.dtype != b.dtype:
        a, b = a.astype(compute), b.astype(compute)
    return jax.lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())), preferred_element_type=compute)


def _chunk_start(index: jax.Array, columns: int, vocab: int) -> jax.Array:
    return jnp.minimum(index * columns, vocab - columns)


def _block(hidden_rows: jax.Array, weight: jax.Array, index: jax.Array, temperature: jax.Array, columns: int,
           compute: Any) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """(z [rows, columns], columns' global ids, their validity mask, the W chunk) of vocabulary chunk ``index``;
    columns an earlier chunk covered (the clamped last chunk) are invalid."""
    vocab = weight.shape[0]
    start = _chunk_start(index, columns, vocab)
    w_chunk = jax.lax.dynamic_slice_in_dim(weight, start, columns, axis=0)
    logits = _dot(hidden_rows, w_chunk, compute, (1, 1)) / temperature
    ids = start + jnp.arange(columns)
    return logits, ids, ids >= index * columns, w_chunk


def _pad_rows(values: jax.Array, rows: int) -> jax.Array:
    """[N, ...] → [chunks, rows, ...], zero-padded to a multiple of ``rows``."""
    n = values.shape[0]
    chunks = max(1, -(-n // rows))
    padded = jnp.pad(values, [(0, chunks * rows - n)] + [(0, 0)] * (values.ndim - 1))
    return padded.reshape((chunks, rows) + values.shape[1:])


def _forward(hidden, weight, ids, temperature, rows, columns):
    compute = temperature.dtype
    n_rows, vocab = hidden.shape[0], weight.shape[0]
    n_chunks = -(-vocab // columns)
    ids_in_range = (ids >= 0) & (ids < vocab)

    def row_chunk(_, inputs):
        h, y = inputs

        def sums(index, z_and_more):
            z, column_ids, valid, _ = z_and_more
            chosen = jnp.sum(jnp.where(valid[None, :] & (column_ids[None, :] == y[:, None]), z, 0), axis=1)
            return chosen, jnp.max(jnp.where(valid[None, :], z, -jnp.inf), axis=1)

        first = _block(h, weight, jnp.asarray(0), temperature, columns, compute)
        chosen, peak = sums(0, first)
        shifted = first[0] - peak[:, None]
        a = jnp.exp(shifted)
        carry = (peak, jnp.sum(a, axis=1), jnp.sum(a * a, axis=1), jnp.sum(a * shifted, axis=1), chosen)

        def vocab_chunk(state, index):
            peak, s1, s2, tilt, chosen = state
            block = _block(h, weight, index, temperature, columns, compute)
            z, _, valid, _ = block
            picked, local_peak = sums(index, block)
            new_peak = jnp.maximum(peak, local_peak)
            shift = peak - new_peak                                   # ≤ 0, finite (chunk 0 had every column)
            factor = jnp.exp(shift)
            centred = jnp.where(valid[None, :], z - new_peak[:, None], 0)
            a = jnp.where(valid[None, :], jnp.exp(centred), 0)
            tilt = factor * (tilt + shift * s1) + jnp.sum(a * centred, axis=1)
            s1 = factor * s1 + jnp.sum(a, axis=1)
            s2 = factor * factor * s2 + jnp.sum(a * a, axis=1)
            return (new_peak, s1, s2, tilt, chosen + picked), None

        if n_chunks > 1:
            carry, _ = jax.lax.scan(vocab_chunk, carry, jnp.arange(1, n_chunks))
        return None, carry

    _, (peak, s1, s2, tilt, chosen) = jax.lax.scan(row_chunk, None, (_pad_rows(hidden, rows), _pad_rows(ids, rows)))
    peak, s1, s2, tilt, chosen = (x.reshape(-1)[:n_rows] for x in (peak, s1, s2, tilt, chosen))
    log_total = jnp.log(s1)
    lse = peak + log_total
    log_probs = jnp.where(ids_in_range, chosen - lse, jnp.nan)      # traced ids outside [0, V): NaN, not a number
    entropy = log_total - tilt / s1
    spp = s2 / jnp.square(s1)
    return (log_probs, entropy, spp), (lse, entropy)


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _statistics(hidden, weight, ids, temperature, rows, columns):
    return _forward(hidden, weight, ids, temperature, rows, columns)[0]


def _statistics_fwd(hidden, weight, ids, temperature, rows, columns):
    outputs, (lse, entropy) = _forward(hidden, weight, ids, temperature, rows, columns)
    return outputs, (hidden, weight, ids, temperature, lse, entropy)


def _statistics_bwd(rows, columns, residuals, cotangents):
    hidden, weight, ids, temperature, lse, entropy = residuals
    g_log_probs, g_entropy, _ = cotangents                     # Σπ²: stop_gradient semantics
    compute = temperature.dtype
    vocab, n_hidden = weight.shape
    n_chunks = -(-vocab // columns)
    g_lp, g_h = g_log_probs.astype(compute), g_entropy.astype(compute)
    per_row = (_pad_rows(hidden, rows), _pad_rows(ids, rows), _pad_rows(lse, rows), _pad_rows(entropy, rows),
               _pad_rows(g_lp, rows), _pad_rows(g_h, rows))

    def row_chunk(state, inputs):
        d_weight, d_tau = state
        h, y, lse_rows, h_rows, glp, gh = inputs

        def vocab_chunk(inner, index):
            d_weight, d_hidden, d_tau = inner
            z, column_ids, valid, w_chunk = _block(h, weight, index, temperature, columns, compute)
            log_probs = jnp.where(valid[None, :], z - lse_rows[:, None], -jnp.inf)
            probs = jnp.exp(log_probs)
            centred = jnp.where(valid[None, :], log_probs + h_rows[:, None], 0)
            chosen = valid[None, :] & (column_ids[None, :] == y[:, None])
            d_logits = glp[:, None] * (chosen.astype(compute) - probs) - gh[:, None] * probs * centred
            d_hidden = d_hidden + _dot(d_logits, w_chunk, compute, (1, 0)) / temperature
            start = _chunk_start(index, columns, vocab)
            update = jax.lax.dynamic_slice_in_dim(d_weight, start, columns, axis=0) + \
                _dot(d_logits, h, compute, (0, 0)) / temperature
            d_weight = jax.lax.dynamic_update_slice_in_dim(d_weight, update, start, axis=0)
            d_tau = d_tau - jnp.sum(jnp.where(valid[None, :], d_logits * z, 0)) / temperature
            return (d_weight, d_hidden, d_tau), None

        start = (d_weight, jnp.zeros(h.shape, compute), d_tau)
        (d_weight, d_hidden, d_tau), _ = jax.lax.scan(vocab_chunk, start, jnp.arange(n_chunks))
        return (d_weight, d_tau), d_hidden

    initial = (jnp.zeros((vocab, n_hidden), compute), jnp.zeros((), compute))
    (d_weight, d_tau), d_hidden = jax.lax.scan(row_chunk, initial, per_row)
    d_hidden = d_hidden.reshape(-1, n_hidden)[:hidden.shape[0]]
    return d_hidden.astype(hidden.dtype), d_weight.astype(weight.dtype), None, d_tau.astype(temperature.dtype)


_statistics.defvjp(_statistics_fwd, _statistics_bwd)
_statistics_jit = jax.jit(_statistics, static_argnums=(4, 5))


def _float_input(name: str, value: Any) -> jax.Array:
    array = check.array(name, value)
    if not jnp.issubdtype(array.dtype, jnp.floating):
        array = array.astype(jnp.float32)
    return array


def fused_linear_token_statistics(hidden: Any, weight: Any, token_ids: Any, *, temperature: Any = 1.0,
                                  chunk_size: int | None = None, vocab_chunk_size: int | None = None,
                                  check_values: bool = True) -> TokenStatistics:
    """log π(y), entropy and Σπ² of softmax(h·Wᵀ/τ) without materialising the logits; the port of
    :func:`otb_spec.token_statistics_from_hidden`.

    With z = h·Wᵀ/τ, m = max z, S₁ = Σ e^{z−m}, S₂ = Σ e^{2(z−m)}, T = Σ e^{z−m}(z − m):
    log π(y) = z_y − m − log S₁,  H = log S₁ − T/S₁,  Σπ² = S₂/S₁², accumulated chunk by chunk (module docstring).

    Args:
      hidden: [..., H] hidden states (float32, bfloat16, float16; float64 with ``jax_enable_x64``; integer and bool
        arrays are read as float32, as the reference reads any real dtype).
      weight: [V, H] the LM head (``lm_head.weight`` layout: one row per token of the vocabulary; dtypes as hidden).
      token_ids: [...] integer ids of the sampled tokens, in [0, V) (any integer dtype). There is no
        ``ignore_index``: give positions you will mask out (HF's −100 labels) any id in [0, V), e.g. the padding
        token's, and mask their statistics afterwards.
      temperature: τ > 0 (a Python number or a scalar array; may be traced, and gets its exact gradient).
      chunk_size: tokens per block (static; the tokens are padded to a multiple of it). Default: a fixed budget of
        values per block divided by its columns.
      vocab_chunk_size: vocabulary columns per block (static). Default V, at most what keeps a float32 copy of a
        chunk of a half-precision W within 64 MiB and, with ``chunk_size`` given, at most max(1024, budget ÷
        chunk_size) — the block stays within the budget (2²² values on CPU, 2²⁶ on GPU) rather than chunk_size × V.
      check_values: reject NaN/±inf in hidden or weight, ids outside [0, V) and τ ≤ 0 — for concrete arrays only (one
        synchronisation) — and finite inputs whose logits overflow the compute dtype (NaN statistics; a second
        synchronisation, after the computation, only where the inputs' extremes allow an overflow). A concrete τ below
        the compute dtype's smallest normal number is always refused. Inside a trace (your ``jit``, ``vmap``, ``grad``)
        values are unknown and not checked: NaN or ±inf inputs propagate, an id outside [0, V) gives log π = NaN, a
        traced τ = 0 gives NaN statistics and a traced τ < 0 the statistics of softmax(z/τ) as computed (finite: check τ
        before tracing it). Shapes and dtypes are always checked.

    Returns:
      :class:`TokenStatistics` (log_probs, entropy, sum_pi_squared), each [...] in float32 (float64 for float64
      inputs). log_probs and entropy are differentiable with respect to hidden, weight and τ through a custom VJP
      that never forms the logits; sum_pi_squared carries no gradient.

    Raises:
      ValueError / TypeError naming ``hidden``, ``weight``, ``token_ids``, ``temperature``, ``chunk_size`` or
      ``vocab_chunk_size``.

    Worked example: π = (¾, ¼) from h = (log 3,), W = [[1], [0]]: log π(0) = log ¾, H ≈ 0.5623, Σπ² = ⅝::

      >>> s = fused_linear_token_statistics(jnp.array([[np.log(3.0)]]), jnp.array([[1.0], [0.0]]), jnp.array([0]))
      >>> [round(float(x[0]), 5) for x in s]
      [-0.28768, 0.56234, 0.625]
    """
    h = _float_input("hidden", hidden)
    w = _float_input("weight", weight)
    if h.ndim < 1 or h.shape[-1] == 0:
        raise ValueError(f"hidden: expected shape [..., H] with H ≥ 1, got {tuple(h.shape)}")
    if w.ndim != 2 or w.shape[0] == 0:
        raise ValueError(f"weight: expected shape [V, H] with V ≥ 1 (the LM head, as torch.nn.Linear stores it), got "
                         f"{tuple(w.shape)}")
    if w.shape[1] != h.shape[-1]:
        raise ValueError(f"weight: expected shape [V, {h.shape[-1]}] (H = hidden.shape[-1] = {h.shape[-1]}), got "
                         f"{tuple(w.shape)}")
    lead = tuple(h.shape[:-1])
    ids = check.token_ids(token_ids, lead, "hidden", "hidden")
    compute = jnp.float64 if jnp.float64 in (h.dtype, w.dtype) else jnp.float32
    tau = _temperature(temperature, compute)
    rows_option = _positive_int("chunk_size", chunk_size)
    columns_option = _positive_int("vocab_chunk_size", vocab_chunk_size)
    vocab = w.shape[0]
    may_overflow = False
    if check_values and not check.is_traced(h, w, ids):
        may_overflow = _check_values(h, w, ids, vocab, tau)
    flat_hidden = h.reshape(-1, h.shape[-1])
    flat_ids = ids.reshape(-1)             # not narrowed: a 64-bit id ≥ 2³¹ must not wrap into [0, V)
    half_weight = w.dtype in (jnp.bfloat16, jnp.float16)
    rows, columns = _blocks(flat_hidden.shape[0], vocab, h.shape[-1], half_weight, rows_option, columns_option)
    log_probs, entropy, spp = _statistics_jit(flat_hidden, w, flat_ids, tau, rows, columns)
    if may_overflow and log_probs.size:
        _check_finite_statistics(log_probs, entropy, compute)
    return TokenStatistics(log_probs.reshape(lead), entropy.reshape(lead), jax.lax.stop_gradient(spp).reshape(lead))


@partial(jax.jit, static_argnums=3)
def _value_summary(hidden: jax.Array, weight: jax.Array, ids: jax.Array, vocab: int) -> jax.Array:
    """[any bad value, max|h|, max|W|] in float32. Σ x·0 is NaN exactly when some element is NaN or ±inf, and XLA
    fuses it into one reduction (``all(isfinite(x))`` allocates a boolean array of the LM head's size first; a max
    does not propagate NaN on XLA's CPU backend); the two maxima bound the logits (:func:`_check_values`)."""
    def finite(values: jax.Array) -> jax.Array:
        return jnp.isfinite(jnp.sum(values * 0))

    bad = ~finite(hidden) | ~finite(weight) | jnp.any((ids < 0) | (ids >= vocab))
    return jnp.stack([bad.astype(jnp.float32), jnp.max(jnp.abs(hidden), initial=0).astype(jnp.float32),
                      jnp.max(jnp.abs(weight), initial=0).astype(jnp.float32)])


def _check_finite_statistics(log_probs: jax.Array, entropy: jax.Array, compute: Any) -> None:
    """Finite inputs whose logits h·Wᵀ/τ overflow the compute dtype give NaN statistics: raise instead (a second
    synchronisation, over two per-token arrays; only where :func:`_check_values` says it could happen)."""
    bad = ~(jnp.isfinite(log_probs) & jnp.isfinite(entropy))
    if check.concrete_flag(jnp.any(bad)):
        first = int(np.argmax(np.asarray(bad)))
        raise ValueError(f"hidden: with weight and temperature, the logits h·Wᵀ/τ overflow {np.dtype(compute).name} "
                         f"(finite inputs; statistics NaN or ±inf at token {first} of the flattened [..., H]): scale "
                         f"them down or compute in float64")


def _check_values(hidden: jax.Array, weight: jax.Array, ids: jax.Array, vocab: int, temperature: jax.Array) -> bool:
    """One synchronisation; on failure the host copies give the reference's message with the first bad index.
    Returns whether finite inputs could overflow the compute dtype (:func:`otb_spec.lm_head._logits_may_overflow`),
    so that only then the statistics are checked after the computation (False inside a trace, or with a traced τ)."""
    summary = check.concrete_values(_value_summary(hidden, weight, ids, vocab))
    if summary is None:
        return False
    if not summary[0]:
        tau = check.concrete_values(temperature)
        if tau is None:
            return False
        return _logits_may_overflow(float(summary[1]), float(summary[2]), hidden.shape[-1], vocab, float(tau),
                                    float(jnp.finfo(temperature.dtype).max))
    for name, value in (("hidden", hidden), ("weight", weight)):
        reference_checks.check_finite(name, check._host(value))
    host = np.asarray(ids)
    bad = (host < 0) | (host >= vocab)
    first = tuple(int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"token_ids: must lie in [0, {vocab}) (the vocabulary), found {int(host[first])} at index {first}")
