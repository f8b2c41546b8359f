"""The Logit-Gradient Proxy: Σπ², the per-token proxy weight, and the analytic gradient it is the norm of.

For one position with logits z ∈ ℝⱽ, policy π = softmax(z) and sampled token y, the gradient of the token's
log-probability with respect to the logits is

    ∇_z log softmax(z)_y = e_y − π                                   (∂ log π_y / ∂z_v = δ_yv − π_v)

and its squared norm is

    ‖e_y − π‖² = (1 − π_y)² + Σ_{v≠y} π_v² = 1 − 2π_y + Σ_v π_v²  =: wₜ          (the proxy weight)

which needs only the forward-pass quantities π_y = exp(log π(y)) and the collision probability
Σπ² = Σ_v π_v² = exp(lse(2z) − 2·lse(z)). Li, Xu et al. 2026 (arXiv 2602.07078) call this the Logit-Gradient Proxy of
the per-token score norm; proofs/T1_proxy_identity.md derives the identity and names the test that checks it.

Numerics. With m = max_v z_v, a_v = exp(z_v − m) ∈ (0, 1], S₁ = Σ a_v and S₂ = Σ a_v²:

    lse(z) = m + log S₁,      Σπ² = S₂ / S₁²          (= exp(lse(2z) − 2·lse(z)) exactly, in real arithmetic)

The ratio form never subtracts two large log-sum-exps, so it stays accurate for |z| up to 1e4 (where
lse(2z) − 2·lse(z) evaluated in float32 loses about three digits). The same three numbers (m, S₁, S₂) are the partials
of a vocabulary shard: :func:`vocab_shard_partials` and :func:`combine_vocab_shards` are the reference for
vocab-parallel implementations, which only need an all-reduce of them.

All functions compute in float64 whatever the input precision (float16 and bfloat16 included) and return float64.
Logits may contain −inf (a token the policy cannot emit, probability exactly 0); NaN and +inf are rejected.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from otb_spec import _validation as check

__all__ = [
    "ShardPartials",
    "sum_pi_squared",
    "log_softmax",
    "logsumexp_and_sum_pi_squared",
    "vocab_shard_partials",
    "combine_vocab_shards",
    "token_energy",
    "token_energy_from_logits",
    "token_log_probs",
    "token_entropy",
    "TokenStatistics",
    "token_statistics_from_logits",
    "logit_gradient",
    "entropy_logit_gradient",
    "log_softmax_jacobian",
]

# Rows of logits processed at once: bounds the float64 temporaries to about 8 · 2**22 bytes = 32 MiB per array.
_DEFAULT_CHUNK_ELEMENTS = 2**22


class ShardPartials(NamedTuple):
    """Softmax statistics of one vocabulary shard (or of the whole vocabulary), per leading position.

    With m = max_v z_v over the shard's entries:

    Attributes:
      max_logit: [...] m.
      sum_exp: [...] S₁ = Σ_v exp(z_v − m).
      sum_exp_squared: [...] S₂ = Σ_v exp(2(z_v − m)).

    Then ``logsumexp = m + log S₁`` and ``sum_pi_squared = S₂ / S₁²`` (the properties below). Partials of disjoint
    shards merge with :func:`combine_vocab_shards`; the merge is associative and commutative, and a shard whose logits
    are all −inf at a position contributes the identity (m, S₁, S₂) = (−inf, 0, 0) there.
    """

    max_logit: np.ndarray
    sum_exp: np.ndarray
    sum_exp_squared: np.ndarray

    @property
    def logsumexp(self) -> np.ndarray:
        """lse(z) = m + log S₁."""
        self._require_mass()
        return self.max_logit + np.log(self.sum_exp)

    @property
    def sum_pi_squared(self) -> np.ndarray:
        """Σ_v π_v² = S₂ / S₁²."""
        self._require_mass()
        return self.sum_exp_squared / np.square(self.sum_exp)

    def _require_mass(self) -> None:
        empty = np.asarray(self.sum_exp) == 0
        if empty.any():
            first = tuple(int(i) for i in np.argwhere(empty)[0])
            raise ValueError(f"partials: every logit is -inf at position {first}; the softmax is undefined there")


def _logits_array(name: str, logits: Any, *, allow_excluded_rows: bool = False) -> np.ndarray:
    array = check.float_array(name, logits, allow_neg_inf=True)
    if array.ndim < 1:
        raise ValueError(f"{name}: expected shape [..., V] with a vocabulary axis, got a scalar")
    if array.shape[-1] == 0:
        raise ValueError(f"{name}: the vocabulary axis is empty (V = 0)")
    if allow_excluded_rows:
        return array
    all_excluded = np.all(array == -np.inf, axis=-1)
    if all_excluded.any():
        first = tuple(int(i) for i in np.argwhere(all_excluded)[0])
        raise ValueError(f"{name}: every logit is -inf at position {first}; the softmax is undefined there")
    return array


def _partials(logits64: np.ndarray) -> ShardPartials:
    max_logit = np.max(logits64, axis=-1)
    excluded = max_logit == -np.inf                         # all −inf here: the identity (−inf, 0, 0)
    shift = np.where(excluded, 0.0, max_logit)
    shifted = np.exp(logits64 - shift[..., None])
    return ShardPartials(max_logit, np.sum(shifted, axis=-1), np.sum(np.square(shifted), axis=-1))


def _chunked_partials(logits64: np.ndarray, chunk_size: int | None) -> ShardPartials:
    lead_shape = logits64.shape[:-1]
    vocab = logits64.shape[-1]
    rows = logits64.reshape(-1, vocab)
    n_rows = rows.shape[0]
    if chunk_size is None:
        chunk_size = max(1, _DEFAULT_CHUNK_ELEMENTS // max(vocab, 1))
    if n_rows <= chunk_size:
        parts = _partials(rows)
    else:
        pieces = [_partials(rows[start:start + chunk_size]) for start in range(0, n_rows, chunk_size)]
        parts = ShardPartials(*(np.concatenate(field) for field in zip(*pieces)))
    return ShardPartials(*(field.reshape(lead_shape) for field in parts))


def _chunk_size_arg(chunk_size: int | None) -> int | None:
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer number of rows or None, got {chunk_size!r}")
    return int(chunk_size)


def sum_pi_squared(logits: Any, *, chunk_size: int | None = None) -> np.ndarray:
    """Collision probability  Σπ² = Σ_v softmax(z)_v² = exp(lse(2z) − 2·lse(z))  per position.

    Args:
      logits: [..., V] real logits (any float precision; −inf allowed for excluded tokens).
      chunk_size: number of positions (rows of the flattened leading dimensions) evaluated at once; ``None`` picks
        enough rows for about 4M logits per chunk. The result does not depend on it.

    Returns:
      [...] float64, in [1/V, 1].

    Worked example: z = (0, 0) → π = (½, ½) → Σπ² = ½; z = (log 3, 0) → π = (¾, ¼) → Σπ² = 9/16 + 1/16 = 0.625::

      >>> sum_pi_squared([[0.0, 0.0], [np.log(3.0), 0.0]]).round(12).tolist()
      [0.5, 0.625]

    Reference: Li, Xu et al. 2026, arXiv 2602.07078 (Logit-Gradient Proxy); verl
    ``calculate_sum_pi_squared_from_logits`` computes the same quantity as exp(lse(2z) − 2·lse(z)).
    """
    logits64 = _logits_array("logits", logits)
    return _chunked_partials(logits64, _chunk_size_arg(chunk_size)).sum_pi_squared


def logsumexp_and_sum_pi_squared(logits: Any, *, chunk_size: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(lse(z), Σπ²) per position from one pass over the vocabulary: [..., V] → ([...], [...]) float64."""
    logits64 = _logits_array("logits", logits)
    parts = _chunked_partials(logits64, _chunk_size_arg(chunk_size))
    return parts.logsumexp, parts.sum_pi_squared


def log_softmax(logits: Any) -> np.ndarray:
    """log softmax(z)_v = z_v − lse(z), [..., V] → [..., V] float64 (−inf where z_v = −inf)."""
    logits64 = _logits_array("logits", logits)
    parts = _partials(logits64)
    return logits64 - parts.logsumexp[..., None]


def vocab_shard_partials(logits_shard: Any) -> ShardPartials:
    """(max, Σexp, Σexp²) of one vocabulary shard: the only numbers a vocab-parallel rank must communicate.

    Args:
      logits_shard: [..., V_k] the logits of this rank's slice of the vocabulary (V_k ≥ 1). Positions where the whole
        shard is −inf get the identity partials (−inf, 0, 0).

    Returns:
      :class:`ShardPartials` with fields of shape [...].
    """
    return _partials(_logits_array("logits_shard", logits_shard, allow_excluded_rows=True))


def combine_vocab_shards(partials: Sequence[ShardPartials]) -> ShardPartials:
    """Merge the partials of disjoint vocabulary shards into those of their union.

    With M = maxₖ mₖ:   S₁ = Σₖ S₁ₖ·exp(mₖ − M),   S₂ = Σₖ S₂ₖ·exp(2(mₖ − M)),   max = M.

    The result's ``.logsumexp`` and ``.sum_pi_squared`` equal those of the unsharded logits (up to rounding), for any
    split of the vocabulary and in any order of the shards.

    Args:
      partials: one :class:`ShardPartials` per shard, all with the same leading shape.

    Returns:
      :class:`ShardPartials` of the union.
    """
    items = list(partials)
    if not items:
        raise ValueError("partials: need at least one shard")
    fields = []
    for position, item in enumerate(items):
        if not isinstance(item, ShardPartials):
            raise TypeError(f"partials[{position}]: expected ShardPartials, got {type(item).__name__}")
        fields.append(tuple(np.asarray(f, dtype=np.float64) for f in item))
    shape = fields[0][0].shape
    for position, (max_logit, sum_exp, sum_exp_sq) in enumerate(fields):
        if max_logit.shape != shape or sum_exp.shape != shape or sum_exp_sq.shape != shape:
            raise ValueError(f"partials[{position}]: leading shape differs from partials[0] ({shape})")
        check.check_finite(f"partials[{position}].max_logit", max_logit, allow_neg_inf=True)
        check.check_finite(f"partials[{position}].sum_exp", sum_exp)
        check.check_finite(f"partials[{position}].sum_exp_squared", sum_exp_sq)
        identity = max_logit == -np.inf
        proper = ~identity & (sum_exp >= 1.0) & (sum_exp_sq > 0.0)
        empty = identity & (sum_exp == 0.0) & (sum_exp_sq == 0.0)
        if not (proper | empty).all():
            raise ValueError(
                f"partials[{position}]: sum_exp must be ≥ 1 and sum_exp_squared > 0 (the shard's maximum contributes"
                " exp(0) = 1 to both), or all three must be (-inf, 0, 0) where the shard is all -inf; were these"
                " partials produced by vocab_shard_partials?"
            )
    maxima = np.stack([f[0] for f in fields])
    overall = np.max(maxima, axis=0)
    shift = np.where(overall == -np.inf, 0.0, overall)       # all shards empty there: stays the identity
    scale = np.exp(maxima - shift)
    sum_exp = np.sum(np.stack([f[1] for f in fields]) * scale, axis=0)
    sum_exp_sq = np.sum(np.stack([f[2] for f in fields]) * np.square(scale), axis=0)
    return ShardPartials(overall, sum_exp, sum_exp_sq)


def token_log_probs(logits: Any, token_ids: Any) -> np.ndarray:
    """log π(y) = z_y − lse(z) for the sampled tokens: logits [..., V], token_ids [...] → [...] float64."""
    logits64 = _logits_array("logits", logits)
    ids = _token_ids(token_ids, logits64.shape)
    parts = _partials(logits64)
    chosen = np.take_along_axis(logits64, ids[..., None], axis=-1)[..., 0]
    return chosen - parts.logsumexp


def token_entropy(logits: Any, *, chunk_size: int | None = None) -> np.ndarray:
    """Entropy H = −Σ_v π_v log π_v per position: [..., V] → [...] float64.

    Evaluated as H = log S₁ + Σ_v π_v (m − z_v) (m = max z, S₁ = Σ_v e^{z_v − m}), a sum of non-negative terms — unlike
    lse(z) − Σ_v π_v z_v, which cancels when π is concentrated. Worked example: uniform over 4 tokens → log 4::

      >>> round(float(token_entropy([0.0, 0.0, 0.0, 0.0])), 12) == round(float(np.log(4.0)), 12)
      True
    """
    return token_statistics_from_logits(logits, None, chunk_size=chunk_size).entropy


class TokenStatistics(NamedTuple):
    """The three per-token quantities a trainer computes from one forward pass (they share the normaliser lse z).

    Attributes:
      log_probs: [...] log π(y) of the given tokens (None when no tokens were given).
      entropy: [...] −Σ π log π.
      sum_pi_squared: [...] Σ π².
    """

    log_probs: np.ndarray | None
    entropy: np.ndarray
    sum_pi_squared: np.ndarray


def token_statistics_from_logits(logits: Any, token_ids: Any, *, chunk_size: int | None = None) -> TokenStatistics:
    """log π(y), entropy and Σπ² in one pass over the logits: [..., V] (and token ids [...]) → three [...] arrays.

    With m = max z, a = e^{z − m}, S₁ = Σa, S₂ = Σa²:  log π(y) = z_y − m − log S₁,  H = log S₁ + Σ (a/S₁)(m − z),
    Σπ² = S₂/S₁². ``token_ids`` may be None (then ``log_probs`` is None).
    """
    logits64 = _logits_array("logits", logits)
    ids = None if token_ids is None else _token_ids(token_ids, logits64.shape)
    chunk_size = _chunk_size_arg(chunk_size)
    lead_shape = logits64.shape[:-1]
    vocab = logits64.shape[-1]
    rows = logits64.reshape(-1, vocab)
    flat_ids = None if ids is None else ids.reshape(-1)
    step = chunk_size or max(1, _DEFAULT_CHUNK_ELEMENTS // vocab)
    log_probs, entropy, spp = (np.empty(rows.shape[0]) for _ in range(3))
    for start in range(0, rows.shape[0], step):
        block = rows[start:start + step]
        peak = np.max(block, axis=-1, keepdims=True)
        shifted = np.exp(block - peak)
        total = np.sum(shifted, axis=-1)
        gap = np.where(np.isinf(block), 0.0, peak - block)        # −inf logits have probability 0: no contribution
        entropy[start:start + step] = np.log(total) + np.sum(shifted * gap, axis=-1) / total
        spp[start:start + step] = np.sum(np.square(shifted), axis=-1) / np.square(total)
        if flat_ids is not None:
            chosen = np.take_along_axis(block, flat_ids[start:start + step, None], axis=-1)[:, 0]
            log_probs[start:start + step] = chosen - peak[:, 0] - np.log(total)
    return TokenStatistics(None if ids is None else log_probs.reshape(lead_shape), entropy.reshape(lead_shape),
                           spp.reshape(lead_shape))


def token_energy(log_probs: Any, sum_pi_squared: Any) -> np.ndarray:
    """Per-token Logit-Gradient Proxy  wₜ = 1 − 2πₜ + Σπ²ₜ  with πₜ = exp(log π(yₜ)).

    Evaluated as (1 − πₜ)² + (Σπ²ₜ − πₜ²), which is the same number in real arithmetic and keeps the (1 − πₜ)² part
    accurate when πₜ → 1 (via ``expm1``). Inputs are checked with the rules of
    :func:`otb_spec._validation.token_statistics` at every position (this function has no mask).

    Args:
      log_probs: [...] log π(yₜ) of the sampled tokens (≤ 0).
      sum_pi_squared: [...] Σ_v π_v² at the same positions, in [π², 1].

    Returns:
      [...] float64 wₜ ∈ [0, 2).

    Worked example: π = (¾, ¼), y = 0 → w = 1 − 1.5 + 0.625 = 0.125 = ‖(¼, −¼)‖²::

      >>> round(float(token_energy(np.log(0.75), 0.625)), 12)
      0.125

    Reference: Li, Xu et al. 2026, arXiv 2602.07078 (Logit-Gradient Proxy).
    """
    raw = check.to_numpy("log_probs", log_probs)
    log_probs64, spp64 = check.token_statistics(raw, sum_pi_squared, None, raw.shape, like="log_probs")
    return _energy(log_probs64, spp64)


def _energy(log_probs64: np.ndarray, spp64: np.ndarray) -> np.ndarray:
    """(1 − π)² + (Σπ² − π²) with π = exp(min(log π, 0)); the clamp keeps junk at masked positions from overflowing."""
    log_pi = np.minimum(log_probs64, 0.0)
    return np.square(np.expm1(log_pi)) + (spp64 - np.square(np.exp(log_pi)))


def token_energy_from_logits(logits: Any, token_ids: Any) -> np.ndarray:
    """wₜ = ‖e_y − softmax(z)‖² = (1 − π_y)² + Σ_{v≠y} π_v² computed directly from the logits.

    No cancellation: both terms are sums of non-negative numbers (1 − π_y = Σ_{v≠y} π_v).

    Args:
      logits: [..., V] logits (−inf allowed).
      token_ids: [...] integer ids of the sampled tokens, in [0, V).

    Returns:
      [...] float64 wₜ ∈ [0, 2).
    """
    logits64 = _logits_array("logits", logits)
    ids = _token_ids(token_ids, logits64.shape)
    max_logit = np.max(logits64, axis=-1, keepdims=True)
    shifted = np.exp(logits64 - max_logit)
    probs = shifted / np.sum(shifted, axis=-1, keepdims=True)
    others = probs.copy()
    np.put_along_axis(others, ids[..., None], 0.0, axis=-1)
    return np.square(np.sum(others, axis=-1)) + np.sum(np.square(others), axis=-1)


def logit_gradient(logits: Any, token_ids: Any) -> np.ndarray:
    """The analytic gradient ∇_z log softmax(z)_y = e_y − softmax(z): logits [..., V], token_ids [...] → [..., V]."""
    logits64 = _logits_array("logits", logits)
    ids = _token_ids(token_ids, logits64.shape)
    max_logit = np.max(logits64, axis=-1, keepdims=True)
    shifted = np.exp(logits64 - max_logit)
    gradient = -(shifted / np.sum(shifted, axis=-1, keepdims=True))
    np.put_along_axis(gradient, ids[..., None], np.take_along_axis(gradient, ids[..., None], axis=-1) + 1.0, axis=-1)
    return gradient


def entropy_logit_gradient(logits: Any) -> np.ndarray:
    """The analytic gradient of the entropy, ∇_z H = −π ⊙ (log π + H): logits [..., V] → [..., V] float64.

    From H = −Σ_v π_v log π_v and ∂π_v/∂z_u = π_v(δ_vu − π_u): ∂H/∂z_u = −π_u(log π_u + 1) + π_u Σ_v π_v(log π_v + 1)
    = −π_u(log π_u + H). It sums to 0 over the vocabulary (softmax is shift-invariant). −inf logits (π = 0) get 0.

    Worked example: π = (¾, ¼): H = 0.5623…, ∂H/∂z₀ = −¾(log ¾ + H) = −0.2060… = −∂H/∂z₁::

      >>> entropy_logit_gradient([np.log(3.0), 0.0]).round(6).tolist()
      [-0.20599, 0.20599]
    """
    logits64 = _logits_array("logits", logits)
    max_logit = np.max(logits64, axis=-1, keepdims=True)
    shifted = np.exp(logits64 - max_logit)
    total = np.sum(shifted, axis=-1, keepdims=True)
    probs = shifted / total
    log_probs = np.where(probs > 0, logits64 - max_logit - np.log(total), 0.0)
    entropy = -np.sum(probs * log_probs, axis=-1, keepdims=True)
    return -probs * (log_probs + entropy) + 0.0           # + 0.0: −inf logits give 0, not −0


def log_softmax_jacobian(logits: Any) -> np.ndarray:
    """Jacobian of log softmax: J[..., y, v] = ∂ log π_y / ∂z_v = δ_yv − π_v, [..., V] → [..., V, V] float64.

    Row y of J is :func:`logit_gradient` for token y; ‖J[y]‖² is the proxy weight w for token y.
    """
    logits64 = _logits_array("logits", logits)
    max_logit = np.max(logits64, axis=-1, keepdims=True)
    shifted = np.exp(logits64 - max_logit)
    probs = shifted / np.sum(shifted, axis=-1, keepdims=True)
    vocab = logits64.shape[-1]
    return np.eye(vocab) - probs[..., None, :]


def _token_ids(token_ids: Any, logits_shape: tuple[int, ...], source: str = "logits") -> np.ndarray:
    ids = check.to_numpy("token_ids", token_ids)
    if ids.dtype.kind not in "iu":
        raise TypeError(f"token_ids: expected integer token ids, got dtype {ids.dtype}")
    if ids.shape != logits_shape[:-1]:
        axis = "vocabulary" if source == "logits" else "hidden"
        raise ValueError(f"token_ids: expected shape {logits_shape[:-1]} ({source} without the {axis} axis), "
                         f"got {ids.shape}")
    vocab = logits_shape[-1]
    bad = (ids < 0) | (ids >= vocab)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise ValueError(f"token_ids: must lie in [0, {vocab}) (the vocabulary), found {int(ids[first])} at index {first}")
    return ids.astype(np.int64)
