"""Token statistics from hidden states and the LM head: the definition that fused-linear kernels implement.

A policy's last layer maps a hidden state h ∈ ℝᴴ to logits through the LM head W ∈ ℝ^{V×H} at sampling temperature
τ > 0:

    z = h·Wᵀ / τ ∈ ℝⱽ,        π = softmax(z)

and a trainer needs three numbers per token — the sampled token's log-probability, the entropy, and the collision
probability OTB's proxy needs:

    log π(y) = z_y − lse(z),        H = −Σ_v π_v log π_v,        Σπ² = Σ_v π_v²

Fused kernels compute them chunk by chunk without ever holding the [N, V] logits (verl's ``FusedLinearForPPO``,
Liger's fused linear cross entropy; ``otb_torch.fused_linear_token_statistics``). Their backward passes need the
gradients with respect to the logits,

    ∂ log π(y)/∂z = e_y − π,        ∂H/∂z = −π ⊙ (log π + H)

(:func:`otb_spec.proxy.logit_gradient`, :func:`otb_spec.proxy.entropy_logit_gradient`), and through the chain rule,
for upstream cotangents g_lp (of log π) and g_H (of H) per token,

    ∂z = g_lp·(e_y − π) − g_H·π ⊙ (log π + H),     ∂h = ∂z·W / τ,     ∂W = Σₙ ∂zₙᵀ hₙ / τ

which :func:`token_statistics_vjp` evaluates. Σπ² is used by OTB as a constant (no gradient).

Index convention: hidden [..., H] (any leading shape, flattened to N tokens), weight [V, H] (the layout of
``torch.nn.Linear.weight`` and of verl's ``lm_head.weight``), token_ids [...] in [0, V). Everything is computed in
float64 (logits materialised in row chunks of about 4M values) and returned as float64; inputs are never modified.
Error bounds for implementations: :func:`otb_spec.tolerances.hidden_statistics_tolerance` and
:func:`otb_spec.tolerances.hidden_gradient_tolerance` (docs/tolerances.md, "Token statistics from hidden states").

Reference: Li, Xu et al. 2026, arXiv 2602.07078 (the Logit-Gradient Proxy needs Σπ² per token).
"""

from __future__ import annotations

from typing import Any, Iterator, NamedTuple

import numpy as np

from otb_spec import _validation as check
from otb_spec.proxy import TokenStatistics, _chunk_size_arg, _token_ids

__all__ = [
    "HiddenGradients",
    "LMHeadInputs",
    "validated_lm_head_inputs",
    "checked_temperature",
    "lm_head_logits",
    "token_statistics_from_hidden",
    "token_statistics_vjp",
    "logit_cotangent",
]

_CHUNK_ELEMENTS = 2**22       # float64 logits per row chunk (32 MiB)


class LMHeadInputs(NamedTuple):
    """Validated inputs of the LM-head functions: hidden [N, H] and weight [V, H] as float64, token ids [N] int64,
    the leading shape of hidden, and τ."""

    hidden: np.ndarray
    weight: np.ndarray
    token_ids: np.ndarray | None
    lead_shape: tuple[int, ...]
    temperature: float


class HiddenGradients(NamedTuple):
    """Gradients of Σₙ (g_lp,ₙ·log πₙ(yₙ) + g_H,ₙ·Hₙ) with respect to the hidden states [..., H] and the LM head
    weight [V, H]."""

    hidden: np.ndarray
    weight: np.ndarray


def validated_lm_head_inputs(hidden: Any, weight: Any, token_ids: Any, temperature: Any) -> LMHeadInputs:
    """Check the four inputs of the LM-head functions; every error names the argument.

    * hidden: real array [..., H] with H ≥ 1, no NaN or ±inf;
    * weight: real array [V, H] with V ≥ 1 and the same H, no NaN or ±inf;
    * token_ids: integers of shape hidden.shape[:-1] in [0, V) (or None where no token is needed);
    * temperature: a finite real number > 0.
    """
    h = check.float_array("hidden", hidden)
    if h.ndim < 1:
        raise ValueError("hidden: expected shape [..., H] with a hidden axis, got a scalar")
    if h.shape[-1] == 0:
        raise ValueError("hidden: the hidden axis is empty (H = 0)")
    w = check.float_array("weight", weight)
    if w.ndim != 2:
        raise ValueError(f"weight: expected shape [V, H] (the LM head, as torch.nn.Linear stores it), got {w.shape}")
    if w.shape[0] == 0:
        raise ValueError("weight: the vocabulary axis is empty (V = 0)")
    if w.shape[1] != h.shape[-1]:
        raise ValueError(f"weight: expected shape [V, {h.shape[-1]}] (H = hidden.shape[-1] = {h.shape[-1]}), got "
                         f"{w.shape}")
    tau = checked_temperature(temperature)
    lead = h.shape[:-1]
    ids = None if token_ids is None else _token_ids(token_ids, lead + (w.shape[0],), "hidden").reshape(-1)
    return LMHeadInputs(h.reshape(-1, h.shape[-1]), w, ids, lead, tau)


def checked_temperature(temperature: Any) -> float:
    """τ as a float, the rule every port applies to the temperature: a finite real number > 0.

    Raises:
      TypeError: naming ``temperature`` for a bool or a value that is not a real number.
      ValueError: naming ``temperature`` for NaN, ±inf or τ ≤ 0.

      >>> checked_temperature(0.7)
      0.7
    """
    return check.scalar("temperature", temperature, minimum=0.0, min_inclusive=False)


def _logits_may_overflow(max_abs_hidden: float, max_abs_weight: float, n_hidden: int, vocab: int,
                         temperature: float, largest: float) -> bool:
    """Whether finite inputs could overflow a dtype whose largest number is ``largest`` while a port forms
    z = h·Wᵀ/τ block by block: every partial sum of h·Wᵀ is at most H·max|h|·max|W|, a logit that times 1/τ, and the
    running sums of a chunked log-sum-exp at most 2V·max|z| (|z − m| ≤ 2·max|z|, each weight e^{z−m} ≤ 1). Below that
    nothing can overflow, so the adapters check their statistics after the forward pass (a host synchronisation)
    only where this is True."""
    product = n_hidden * max_abs_hidden * max_abs_weight
    return 2 * vocab * product * max(1.0, 1.0 / temperature) >= largest


def lm_head_logits(hidden: Any, weight: Any, *, temperature: float = 1.0) -> np.ndarray:
    """The logits z = h·Wᵀ/τ that fused kernels never materialise: [..., H], [V, H] → [..., V] float64.

    Worked example: h = (1, 0), W = [[2, 0], [0, 1], [1, 1]], τ = 2 → z = (1, 0, ½)::

      >>> lm_head_logits([1.0, 0.0], [[2.0, 0.0], [0.0, 1.0], [1.0, 1.0]], temperature=2.0).tolist()
      [1.0, 0.0, 0.5]
    """
    inputs = validated_lm_head_inputs(hidden, weight, None, temperature)
    return (inputs.hidden @ inputs.weight.T / inputs.temperature).reshape(inputs.lead_shape + (inputs.weight.shape[0],))


def _row_chunks(n_rows: int, vocab: int, chunk_size: int | None) -> Iterator[slice]:
    step = chunk_size or max(1, _CHUNK_ELEMENTS // vocab)
    for start in range(0, n_rows, step):
        yield slice(start, min(start + step, n_rows))


def _softmax_parts(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(log π [n, V], π [n, V], H [n]) of a chunk of logits (all finite), with H = log S₁ + Σ (a/S₁)(m − z) (a sum of
    non-negative terms; m = max z, a = e^{z − m}, S₁ = Σ a)."""
    peak = logits.max(axis=-1, keepdims=True)
    shifted = np.exp(logits - peak)
    total = shifted.sum(axis=-1, keepdims=True)
    probs = shifted / total
    log_probs = logits - peak - np.log(total)
    entropy = np.log(total[:, 0]) + np.sum(probs * (peak - logits), axis=-1)
    return log_probs, probs, entropy


def token_statistics_from_hidden(hidden: Any, weight: Any, token_ids: Any, *, temperature: float = 1.0,
                                 chunk_size: int | None = None) -> TokenStatistics:
    """log π(y), entropy and Σπ² of softmax(h·Wᵀ/τ) per token: [..., H], [V, H], [...] → three [...] float64 arrays.

    With z = h·Wᵀ/τ, m = max z, a = e^{z − m}, S₁ = Σa, S₂ = Σa²:
    log π(y) = z_y − m − log S₁,  H = log S₁ + Σ_v (a_v/S₁)(m − z_v),  Σπ² = S₂/S₁² — the same quantities as
    :func:`otb_spec.token_statistics_from_logits` of the logits :func:`lm_head_logits`.

    Args:
      hidden: [..., H] hidden states (any real dtype; bfloat16 and float16 are read exactly).
      weight: [V, H] the LM head (``lm_head.weight``).
      token_ids: [...] integer ids of the sampled tokens in [0, V); None gives ``log_probs=None``.
      temperature: τ > 0, the sampling temperature the logits are divided by.
      chunk_size: tokens per chunk of materialised float64 logits (default: about 4M logits per chunk); the result
        does not depend on it.

    Worked example: π = (¾, ¼) from h = (log 3,), W = [[1], [0]]: log π(0) = log ¾, H = −¾ log ¾ − ¼ log ¼, Σπ² = ⅝::

      >>> s = token_statistics_from_hidden([[np.log(3.0)]], [[1.0], [0.0]], [0])
      >>> [round(float(x[0]), 12) for x in s]
      [-0.287682072452, 0.562335144619, 0.625]

    Raises:
      ValueError: naming ``hidden``, ``weight``, ``token_ids`` or ``temperature`` for disagreeing shapes, ids outside
        [0, V), NaN or ±inf in hidden or weight, or τ ≤ 0 (TypeError for non-numeric input).
    """
    inputs = validated_lm_head_inputs(hidden, weight, token_ids, temperature)
    chunk_size = _chunk_size_arg(chunk_size)
    n_rows, vocab = inputs.hidden.shape[0], inputs.weight.shape[0]
    log_probs, entropy, spp = (np.empty(n_rows) for _ in range(3))
    for rows in _row_chunks(n_rows, vocab, chunk_size):
        logits = inputs.hidden[rows] @ inputs.weight.T / inputs.temperature
        every_log_prob, probs, entropy[rows] = _softmax_parts(logits)
        spp[rows] = np.sum(np.square(probs), axis=-1)
        if inputs.token_ids is not None:
            log_probs[rows] = np.take_along_axis(every_log_prob, inputs.token_ids[rows, None], axis=-1)[:, 0]
    shape = inputs.lead_shape
    return TokenStatistics(None if inputs.token_ids is None else log_probs.reshape(shape), entropy.reshape(shape),
                           spp.reshape(shape))


def _cotangent(name: str, value: Any, shape: tuple[int, ...]) -> np.ndarray:
    if value is None:
        return np.zeros(int(np.prod(shape, dtype=np.int64)))
    return check.float_array(name, value, shape=shape, like="token_ids").reshape(-1)


def token_statistics_vjp(hidden: Any, weight: Any, token_ids: Any, log_probs_cotangent: Any, entropy_cotangent: Any,
                         *, temperature: float = 1.0, chunk_size: int | None = None) -> HiddenGradients:
    """The analytic vector-Jacobian product of (log π(y), H) with respect to (hidden, weight).

    For cotangents g_lp and g_H per token (the upstream gradients of the log-probabilities and the entropies):

        ∂zₙ = g_lp,ₙ·(e_{yₙ} − πₙ) − g_H,ₙ·πₙ ⊙ (log πₙ + Hₙ)              [V] per token
        ∂hₙ = ∂zₙ·W / τ                                                   [..., H]
        ∂W  = Σₙ ∂zₙᵀ hₙ / τ                                              [V, H]

    i.e. the gradients of Σₙ (g_lp,ₙ log πₙ(yₙ) + g_H,ₙ Hₙ). Σπ² has no gradient (OTB uses it as a constant).

    Args:
      hidden, weight, token_ids, temperature, chunk_size: as in :func:`token_statistics_from_hidden`.
      log_probs_cotangent: [...] g_lp, or None for 0.
      entropy_cotangent: [...] g_H, or None for 0.

    Returns:
      :class:`HiddenGradients` (hidden [..., H], weight [V, H]), float64.

    Worked example: one token, V = 2, π = (½, ½) (h = 0), y = 0, g_lp = 1, g_H = 0: ∂z = (½, −½), so
    ∂h = ∂z·W = ½(W₀ − W₁) and ∂W = ∂zᵀh = 0::

      >>> g = token_statistics_vjp([[0.0, 0.0]], [[1.0, 3.0], [0.0, 1.0]], [0], [1.0], [0.0])
      >>> g.hidden.tolist(), g.weight.tolist()
      ([[0.5, 1.0]], [[0.0, 0.0], [0.0, 0.0]])
    """
    inputs = validated_lm_head_inputs(hidden, weight, token_ids, temperature)
    if inputs.token_ids is None:
        raise TypeError("token_ids: expected integer token ids, got None (log π(y) needs the sampled tokens)")
    chunk_size = _chunk_size_arg(chunk_size)
    g_log_probs = _cotangent("log_probs_cotangent", log_probs_cotangent, inputs.lead_shape)
    g_entropy = _cotangent("entropy_cotangent", entropy_cotangent, inputs.lead_shape)
    n_rows, vocab = inputs.hidden.shape[0], inputs.weight.shape[0]
    d_hidden = np.empty_like(inputs.hidden)
    d_weight = np.zeros_like(inputs.weight)
    for rows in _row_chunks(n_rows, vocab, chunk_size):
        d_logits = logit_cotangent(inputs.hidden[rows] @ inputs.weight.T / inputs.temperature,
                                   inputs.token_ids[rows], g_log_probs[rows], g_entropy[rows])
        d_hidden[rows] = d_logits @ inputs.weight / inputs.temperature
        d_weight += d_logits.T @ inputs.hidden[rows] / inputs.temperature
    return HiddenGradients(d_hidden.reshape(inputs.lead_shape + (inputs.hidden.shape[1],)), d_weight)


def logit_cotangent(logits: np.ndarray, token_ids: np.ndarray, log_probs_cotangent: np.ndarray,
                    entropy_cotangent: np.ndarray) -> np.ndarray:
    """∂z = g_lp·(e_y − π) − g_H·π ⊙ (log π + H) for a chunk of logits [n, V] (float64, finite), ids [n] and
    cotangents [n] — the logit gradient :func:`token_statistics_vjp` propagates to h and W."""
    log_probs, probs, entropy = _softmax_parts(logits)
    d_logits = -log_probs_cotangent[:, None] * probs - entropy_cotangent[:, None] * probs * (log_probs + entropy[:, None])
    d_logits[np.arange(len(token_ids)), token_ids] += log_probs_cotangent
    return d_logits
