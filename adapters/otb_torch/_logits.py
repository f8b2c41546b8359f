"""Σπ², log π(y) and entropy from logits in PyTorch, with bounded temporaries; vocab-shard partials.

The logits are processed in row chunks of about ``_CHUNK_ELEMENTS`` values (4 MiB of float32: 32 rows of a 32768-word
vocabulary, at least one row; on CUDA ``_CUDA_CHUNK_ELEMENTS``, 32 MiB, at least 64 rows) through preallocated float32
buffers (float64 for float64 logits), so the extra memory is a fixed buffer per chunk plus the result, whatever the
batch — the plain ``exp(logsumexp(2z) − 2·logsumexp(z))`` allocates about twice the size of float32 logits (six
times that of bf16 logits, upcast to float32 first: measured on CUDA); on the CPU a chunk that fits in cache is also
the fastest, on CUDA one that keeps the number of kernel launches down. Per chunk: m = max z, a = e^{z − m}, S₁ = Σa,
S₂ = Σa² (a batched dot product, no temporary); after the last chunk Σπ² = S₂/S₁² — the reference's ratio form,
accurate for |z| up to 1e4 even in float32. The value checks read the per-row maxima m (no extra pass).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Sequence

import torch

from otb_spec import _validation as reference_checks
from otb_torch import _checks as check

__all__ = [
    "calculate_sum_pi_squared_from_logits",
    "sum_pi_squared",
    "TokenStatistics",
    "token_statistics_from_logits",
    "ShardPartials",
    "vocab_shard_partials",
    "combine_vocab_shards",
]

_CHUNK_ELEMENTS = 2**20       # per buffer (4 MiB of float32): of 1–512 rows of 32768 logits, 8–64 were about as fast
# On CUDA a chunk costs kernel launches, not cache misses: larger chunks, and at least 64 rows (a reduction over a few
# rows of a long vocabulary leaves the GPU idle). Σπ² on an H100 (benchmarks/results/gpu-check-2026-11-26-nvidia-h100-
# 80gb-hbm3.md; check_values=False): [4096, 32768] float32, 256 rows: 2.12 ms, 32 MiB, against 2.73 ms and 1 GiB for the
# plain formula (32 rows: 7.65 ms); [4096, 152064] bf16, 64 rows: 13.4 ms, 37 MiB, against 14.2 ms and 7 GiB (32 rows:
# 15.6 ms).
_CUDA_CHUNK_ELEMENTS = 2**23  # per buffer (32 MiB of float32)
_CUDA_MIN_CHUNK_ROWS = 64


def _logits(name: str, logits: Any) -> torch.Tensor:
    """The logits as a tensor with a non-empty vocabulary axis (metadata only; values: :func:`_check_maxima`)."""
    z = check.tensor(name, logits)
    if z.dim() < 1:
        raise ValueError(f"{name}: expected shape [..., V] with a vocabulary axis, got a scalar")
    if z.shape[-1] == 0:
        raise ValueError(f"{name}: the vocabulary axis is empty (V = 0)")
    return z


def _check_maxima(name: str, z: torch.Tensor, maxima: torch.Tensor, allow_excluded_rows: bool = False) -> None:
    """Reject NaN, +inf and (unless allowed) rows of −inf only, from each row's maximum, which the computation needs
    anyway: it is NaN if the row holds a NaN, +inf if it holds +inf, −inf if every logit is −inf. One
    synchronisation; the offending logits are then read on the host for the reference's message."""
    bad = torch.isnan(maxima) | (maxima == math.inf)
    if not allow_excluded_rows:
        bad = bad | (maxima == -math.inf)
    if maxima.numel() == 0 or not bool(bad.any()):
        return
    host = check._host(z)
    array = reference_checks.float_array(name, host, allow_neg_inf=True)
    excluded = (array == -math.inf).all(-1)
    if excluded.any() and not allow_excluded_rows:
        first = tuple(int(i) for i in torch.nonzero(torch.as_tensor(excluded))[0])
        raise ValueError(f"{name}: every logit is -inf at position {first}; the softmax is undefined there")


def _chunk_rows(vocab: int, chunk_size: int | None, device: torch.device | None = None) -> int:
    """Rows per chunk: ``chunk_size`` if given, else ``_CHUNK_ELEMENTS // V`` (at least 1) — on CUDA
    ``_CUDA_CHUNK_ELEMENTS // V``, at least ``_CUDA_MIN_CHUNK_ROWS``."""
    if chunk_size is None:
        if device is not None and device.type == "cuda":
            return max(_CUDA_MIN_CHUNK_ROWS, _CUDA_CHUNK_ELEMENTS // vocab)
        return max(1, _CHUNK_ELEMENTS // vocab)
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected a positive integer number of rows or None, got {chunk_size!r}")
    return chunk_size


def _compute_dtype(z: torch.Tensor) -> torch.dtype:
    return torch.float64 if z.dtype == torch.float64 else torch.float32


def _out_dtype(z: torch.Tensor) -> torch.dtype:
    return z.dtype if z.is_floating_point() else torch.float32


def _row_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Σ_v a[r, v]·b[r, v] per row, as a batched matrix product (no temporary of the row's size)."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).reshape(-1)


@torch.no_grad()
def sum_pi_squared(logits: Any, *, chunk_size: int | None = None, check_values: bool = True) -> torch.Tensor:
    """Σπ² = Σ_v softmax(z)_v² per position: [..., V] → [...] in the logits' dtype (computed in float32/float64).

    Args:
      logits: [..., V] tensor (any float dtype; −inf allowed for excluded tokens).
      chunk_size: rows (flattened leading positions) per chunk; default ``_CHUNK_ELEMENTS // V`` (at least 1; on
        CUDA ``_CUDA_CHUNK_ELEMENTS // V``, at least 64 rows).
      check_values: reject NaN, +inf and all −inf rows (one host synchronisation).
    """
    z = _logits("logits", logits)
    lead, vocab = z.shape[:-1], z.shape[-1]
    rows = z.reshape(-1, vocab)
    n = rows.shape[0]
    dtype = _compute_dtype(z)
    totals = torch.empty((2, n), dtype=dtype, device=z.device)          # S₁ and S₂ per row
    maxima = torch.empty((n, 1), dtype=dtype, device=z.device)
    step = _chunk_rows(vocab, chunk_size, z.device)
    buffer = torch.empty((min(step, n), vocab), dtype=dtype, device=z.device)
    for start in range(0, n, step):               # five operations per chunk; the ratio once, after the loop
        block = rows[start:start + step]
        count = block.shape[0]
        a = buffer[:count]
        peak = maxima[start:start + count]
        if block.dtype == dtype:
            torch.amax(block, -1, keepdim=True, out=peak)
        else:
            peak.copy_(block.amax(-1, keepdim=True))
        torch.sub(block, peak, out=a)
        a.exp_()
        torch.sum(a, -1, out=totals[0, start:start + count])
        torch.bmm(a.unsqueeze(1), a.unsqueeze(2), out=totals[1, start:start + count].view(count, 1, 1))
    if check_values:
        _check_maxima("logits", z, maxima)
    return (totals[1] / totals[0].square()).reshape(lead).to(_out_dtype(z))


def calculate_sum_pi_squared_from_logits(logits: torch.Tensor, **kwargs: Any) -> torch.Tensor:
    """Drop-in for verl's ``calculate_sum_pi_squared_from_logits(logits) → Σπ²`` (memory-bounded, ratio form)."""
    return sum_pi_squared(logits, **kwargs)


class TokenStatistics(NamedTuple):
    """log π(y) (None without token ids), entropy and Σπ², each [...] in the logits' dtype."""

    log_probs: torch.Tensor | None
    entropy: torch.Tensor
    sum_pi_squared: torch.Tensor


def checked_token_ids(token_ids: Any, lead: tuple[int, ...], vocab: int, device: torch.device,
                      check_values: bool, source: str = "logits") -> torch.Tensor:
    """Token ids as an int64 tensor of shape ``lead`` on ``device`` (that of ``source``, the argument they go with);
    with ``check_values``, ids outside [0, V) raise the reference's error (one host synchronisation)."""
    ids = check.tensor("token_ids", token_ids)
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise TypeError(f"token_ids: expected integer token ids, got dtype {ids.dtype}")
    if tuple(ids.shape) != tuple(lead):
        axis = "vocabulary" if source == "logits" else "hidden"
        raise ValueError(f"token_ids: expected shape {tuple(lead)} ({source} without the {axis} axis), got "
                         f"{tuple(ids.shape)}")
    if ids.device != device:
        raise ValueError(f"token_ids: on {ids.device} but {source} is on {device}")
    ids = ids.to(torch.int64)        # before comparing with V: in a narrow dtype V wraps around (300 is 44 in uint8)
    if check_values and ids.numel() and bool(((ids < 0) | (ids >= vocab)).any()):
        host = check._host(ids)
        first = tuple(int(i) for i in torch.nonzero(torch.as_tensor((host < 0) | (host >= vocab)))[0])
        raise ValueError(f"token_ids: must lie in [0, {vocab}) (the vocabulary), found {int(host[first])} at index "
                         f"{first}")
    return ids


@torch.no_grad()
def token_statistics_from_logits(logits: Any, token_ids: Any = None, *, chunk_size: int | None = None,
                                 check_values: bool = True) -> TokenStatistics:
    """log π(y), entropy and Σπ² in one pass (they share m and S₁ = Σ e^{z − m}); the port of
    :func:`otb_spec.token_statistics_from_logits`.

    H = log S₁ − Σ_v (a_v/S₁)(z_v − m), a sum of non-negative terms. Two chunk buffers. Token ids outside [0, V)
    raise with ``check_values``; without it they give log π = NaN there (as otb_jax does under a trace).
    """
    z = _logits("logits", logits)
    lead, vocab = z.shape[:-1], z.shape[-1]
    ids = None if token_ids is None else checked_token_ids(token_ids, tuple(lead), vocab, z.device,
                                                           check_values).reshape(-1)
    rows = z.reshape(-1, vocab)
    n = rows.shape[0]
    dtype = _compute_dtype(z)
    step = _chunk_rows(vocab, chunk_size, z.device)
    shifted = torch.empty((min(step, n), vocab), dtype=dtype, device=z.device)
    exps = torch.empty_like(shifted)
    entropy = torch.empty(n, dtype=dtype, device=z.device)
    spp = torch.empty(n, dtype=dtype, device=z.device)
    log_probs = None if ids is None else torch.empty(n, dtype=dtype, device=z.device)
    maxima = torch.empty((n, 1), dtype=dtype, device=z.device)
    for start in range(0, n, step):
        block = rows[start:start + step]
        count = block.shape[0]
        d, a = shifted[:count], exps[:count]
        peak = maxima[start:start + count]
        peak.copy_(block.amax(-1, keepdim=True))
        torch.sub(block, peak, out=d)
        torch.exp(d, out=a)
        total = a.sum(-1)
        log_total = torch.log(total)
        spp[start:start + count] = _row_dot(a, a) / torch.square(total)
        d.nan_to_num_(nan=0.0, neginf=0.0)              # −inf logits have a = 0: no contribution to Σ a·(z − m)
        entropy[start:start + count] = log_total - _row_dot(a, d) / total
        if log_probs is not None:        # ids outside [0, V) (check_values=False): NaN, as otb_jax under a trace
            mine = ids[start:start + count]
            chosen = block.gather(1, mine.clamp(0, vocab - 1)[:, None]).to(dtype)
            log_probs[start:start + count] = torch.where((mine >= 0) & (mine < vocab),
                                                         (chosen - peak)[:, 0] - log_total, math.nan)
    if check_values:
        _check_maxima("logits", z, maxima)
    out = _out_dtype(z)
    return TokenStatistics(None if log_probs is None else log_probs.reshape(lead).to(out),
                           entropy.reshape(lead).to(out), spp.reshape(lead).to(out))


class ShardPartials(NamedTuple):
    """(max, Σexp, Σexp²) of a vocabulary shard per position — the numbers a vocab-parallel rank all-reduces."""

    max_logit: torch.Tensor
    sum_exp: torch.Tensor
    sum_exp_squared: torch.Tensor

    @property
    def logsumexp(self) -> torch.Tensor:
        return self.max_logit + torch.log(self.sum_exp)

    @property
    def sum_pi_squared(self) -> torch.Tensor:
        return self.sum_exp_squared / torch.square(self.sum_exp)


@torch.no_grad()
def vocab_shard_partials(logits_shard: Any, *, check_values: bool = True) -> ShardPartials:
    """Partials of one shard (identity (−inf, 0, 0) where the shard is all −inf); the port of
    :func:`otb_spec.vocab_shard_partials`."""
    z = _logits("logits_shard", logits_shard)
    dtype = _compute_dtype(z)
    peak = z.amax(-1).to(dtype)
    if check_values:
        _check_maxima("logits_shard", z, peak, allow_excluded_rows=True)
    shift = torch.where(torch.isinf(peak), torch.zeros_like(peak), peak)
    a = torch.exp(z.to(dtype) - shift[..., None])
    return ShardPartials(peak, a.sum(-1), torch.square(a).sum(-1))


def combine_vocab_shards(partials: Sequence[ShardPartials]) -> ShardPartials:
    """Merge disjoint shards: M = maxₖ mₖ, S₁ = Σₖ S₁ₖe^{mₖ−M}, S₂ = Σₖ S₂ₖe^{2(mₖ−M)}; the port of
    :func:`otb_spec.combine_vocab_shards`."""
    items = list(partials)
    if not items:
        raise ValueError("partials: need at least one shard")
    maxima = torch.stack([item.max_logit for item in items])
    overall = maxima.amax(0)
    shift = torch.where(torch.isinf(overall), torch.zeros_like(overall), overall)
    scale = torch.exp(maxima - shift)
    sum_exp = (torch.stack([item.sum_exp for item in items]) * scale).sum(0)
    sum_exp_squared = (torch.stack([item.sum_exp_squared for item in items]) * torch.square(scale)).sum(0)
    return ShardPartials(overall, sum_exp, sum_exp_squared)
