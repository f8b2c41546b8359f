"""log π(y), entropy and Σπ² from hidden states and the LM head, never materialising the logits; the port of
:func:`otb_spec.token_statistics_from_hidden`, with exact gradients of log π and of the entropy.

For hidden [..., H], weight [V, H] and ids [...], with z = h·Wᵀ/τ (N tokens): the forward pass walks the vocabulary
in chunks of ``vocab_chunk_size`` columns and, inside each, the tokens in chunks of ``chunk_size`` rows; each block
of logits z[rows, columns] is formed by one matmul into a fixed buffer and folded into running per-token sums
(online rescaling across vocabulary chunks):

    m = max z,   S₁ = Σ e^{z−m},   S₂ = Σ e^{2(z−m)},   T = Σ e^{z−m}(z − m),   z_y

    log π(y) = z_y − m − log S₁,   H = log S₁ − T/S₁,   Σπ² = S₂/S₁²

The backward pass needs only lse = m + log S₁ and H per token (saved: two floats per token) to rebuild any block of
the logit cotangent, ∂z = g_lp(e_y − π) − g_H·π ⊙ (log π + H) with π = e^{z − lse}, and sends it through two matmuls:
∂h += ∂z·W/τ and ∂W += ∂zᵀ·h/τ. The e_y term is added per token (a gather of W's rows and an index-add into ∂W), so a
block costs one matmul and four elementwise passes forward, three matmuls and four passes backward in torch ops. On
CPU in float32 the native kernel (``_kernel.c``: otb_fused_fold_float32, otb_fused_cotangent_float32; one thread per
share of rows, results independent of the thread count) does a block's elementwise work row by row instead: forward,
each row read twice (maximum, then the three sums; the second read from cache) and never written; backward, one read
and one write of each row (z ← c·π in place).

Memory (beyond inputs, outputs and the returned gradients): one [rows, columns] buffer in the compute dtype with the
native kernel (2²² values = 16 MiB in float32 on CPU), two with torch ops (2 × 2²² values: 32 MiB in float32 on CPU
without the kernel, 64 MiB in float64; 2 × 2²⁶ values = 512 MiB in float32 on CUDA), five per-token floats, two
temporaries of 2¹⁸ values (1 MiB in float32) in the backward pass's e_y term, and for half-precision inputs float32
copies of one vocabulary chunk of W and of one row block of h (on CUDA, where both are of one half dtype and torch has
the matmul's ``out_dtype``, in the backward pass only) and, in the backward pass, a float32 accumulator for ∂W, and
for ∂h when the hidden states are half precision — nothing that grows with N·V. The matmul library may add its own
packing buffers (of the order of one block's operands); benchmarks/bench_fused.py measures the whole peak.

bf16/fp16 inputs are accumulated in float32 (float64 inputs in float64); log π, entropy and Σπ² are returned in that
precision, Σπ² detached (OTB uses it as a constant). On CUDA the blocks z = h·Wᵀ/τ (forward, and their recomputation in
the backward pass) multiply the half-precision operands themselves into float32 (torch's matmul with ``out_dtype``,
where this torch has it: tensor cores); a product of two bf16 or two fp16 numbers is exact in float32, and the tests
hold these blocks to the same float32 bound as float32 copies (passed on an H100) — which is what the CPU multiplies,
and CUDA in the backward's ∂h and ∂W products (the cotangent is float32: rounding it to bf16 would change the bound).
The float32 matmuls follow torch's own settings (``torch.set_float32_matmul_precision``,
``torch.backends.cuda.matmul.allow_tf32``; "highest" and off by default): with TF32 or bf16 passes allowed, the float32
error bounds do not hold.

On CUDA (an H100, H = 4096, V = 152 064, N = 4096; benchmarks/results/gpu-check-2026-11-26-nvidia-h100-80gb-hbm3.md):
float32 inputs run at 1.05–1.13× the time of the matmuls alone; bf16 inputs forward at 0.82× the time of materialising
the logits (0.054× of them in extra memory), forward + backward at 3.4× — the backward's two float32 matmuls are its
floor (a float32 matmul of this size takes 0.10 s, the materialised forward + backward 0.072 s).
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
from torch.autograd.function import once_differentiable

from otb_torch import _native
from otb_torch._logits import TokenStatistics, _row_dot, checked_token_ids
from otb_spec.lm_head import _logits_may_overflow, checked_temperature

__all__ = ["fused_linear_token_statistics"]

_BLOCK_ELEMENTS = {"cpu": 2**22, "cuda": 2**26}     # values per [rows, columns] buffer
_WEIGHT_CHUNK_ELEMENTS = 2**24                     # float32 copy of a chunk of half-precision W (64 MiB)
_GATHER_ELEMENTS = 2**18                           # [rows, H] temporaries of the backward's e_y term
_HALF_PRECISION = (torch.bfloat16, torch.float16)
_HALF_PRODUCTS: dict[tuple[str, int | None, torch.dtype], bool] = {}     # (device type, index, dtype) → usable


def _half_products(device: torch.device, *operands: torch.Tensor) -> bool:
    """True where z = h·Wᵀ/τ can run on bf16/fp16 operands themselves into a float32 block: CUDA, both operands of
    one half dtype, and torch's matmul with ``out_dtype`` (CUDA only; probed once per device and dtype). Each product
    of two bf16 (8-bit significand) or fp16 (11-bit) numbers is exact in float32 and the sums are accumulated in
    float32 (tensor cores may truncate rather than round there): the tests hold these blocks to the same float32 bound
    as the upcast operands' matmul, and it held on an H100. Probed with both forms the passes use: β = 0 into a
    buffer, and β = 1 onto itself (the backward's z ← h·Wᵀ/τ − lse)."""
    kind = operands[0].dtype
    if device.type != "cuda" or kind not in _HALF_PRECISION or any(t.dtype != kind for t in operands):
        return False
    key = (device.type, device.index, kind)
    if key not in _HALF_PRODUCTS:
        probe = torch.ones((2, 2), dtype=kind, device=device)
        out = torch.empty((2, 2), dtype=torch.float32, device=device)
        try:                     # whether the call dispatches; no read of its result (no host synchronisation)
            torch.addmm(out, probe, probe.t(), beta=0, alpha=0.5, out_dtype=torch.float32, out=out)
            torch.addmm(out, probe, probe.t(), beta=1, alpha=0.5, out_dtype=torch.float32, out=out)
            _HALF_PRODUCTS[key] = True
        except (RuntimeError, NotImplementedError, TypeError):     # a torch without out_dtype on this device
            _HALF_PRODUCTS[key] = False
    return _HALF_PRODUCTS[key]


def _block_logits(z: torch.Tensor, h: torch.Tensor, w_chunk: torch.Tensor, scale: float, *, half: bool,
                  accumulate: bool = False) -> None:
    """z ← h·Wᵀ·scale (+ z if ``accumulate``) in z's dtype: from the half-precision operands themselves where
    ``half`` (see :func:`_half_products`), else from their copies in z's dtype (views when already in it)."""
    beta = 1 if accumulate else 0
    if half:
        torch.addmm(z, h, w_chunk.t(), beta=beta, alpha=scale, out_dtype=z.dtype, out=z)
    else:
        z.addmm_(h.to(z.dtype), w_chunk.to(z.dtype).t(), beta=beta, alpha=scale)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _positive_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise ValueError(f"{name}: expected a positive integer or None, got {value!r}")
    return int(value)


def _temperature(value: Any) -> float:
    """τ from a number or a one-element tensor, by the reference's rule (otb_spec.lm_head.checked_temperature)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise ValueError(f"temperature: expected a scalar, got shape {tuple(value.shape)}")
        if value.requires_grad:
            raise ValueError("temperature: a tensor that requires grad; these statistics give no gradient with respect "
                             "to τ (otb_jax's do): pass a number or temperature.detach()")
        value = value.item()
    return checked_temperature(value)


def _check_reciprocal(temperature: float, dtype: torch.dtype) -> None:
    """1/τ, which the blocks multiply by in the compute dtype, must be finite there."""
    if 1.0 / temperature > torch.finfo(dtype).max:
        raise ValueError(f"temperature: τ = {temperature!r} is too small for {dtype} logits (1/τ = "
                         f"{1.0 / temperature:.3g} overflows {dtype})")


def _may_overflow(extremes: list, n_hidden: int, vocab: int, temperature: float, dtype: torch.dtype) -> bool:
    """:func:`otb_spec.lm_head._logits_may_overflow` from the inputs' [[min, max] of h, [min, max] of W]."""
    (h_low, h_high), (w_low, w_high) = extremes
    return _logits_may_overflow(max(abs(h_low), abs(h_high)), max(abs(w_low), abs(w_high)), n_hidden, vocab,
                                temperature, torch.finfo(dtype).max)


def _check_finite_statistics(log_probs: torch.Tensor, entropy: torch.Tensor, dtype: torch.dtype) -> None:
    """Finite inputs whose logits h·Wᵀ/τ overflow the compute dtype give NaN statistics: raise instead (one host
    synchronisation, over two per-token arrays; only where :func:`_may_overflow` says it could happen)."""
    bad = ~(torch.isfinite(log_probs) & torch.isfinite(entropy))
    if bool(bad.any()):
        first = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"hidden: with weight and temperature, the logits h·Wᵀ/τ overflow {dtype} (finite inputs; "
                         f"statistics NaN or ±inf at token {first} of the flattened [..., H]): scale them down or "
                         f"compute in float64")


def _float_tensor(name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name}: expected a floating tensor, got dtype {value.dtype}")
    return value


def _first_bad(name: str, value: torch.Tensor) -> None:
    bad = ~torch.isfinite(value.detach())
    if bool(bad.any()):
        first = tuple(int(i) for i in torch.nonzero(bad)[0])
        raise ValueError(f"{name}: contains NaN or ±inf (first at index {first}: {float(value.detach()[first])!r})")


def _blocks(n_rows: int, vocab: int, device: torch.device, dtype: torch.dtype, weight_dtype: torch.dtype,
            n_hidden: int, chunk_size: int | None, vocab_chunk_size: int | None) -> tuple[int, int]:
    """(rows, columns) per block, rows × columns ≤ the budget: square blocks (√budget on a side) unless there are fewer
    tokens, in which case the columns take the rest of the budget; fewer columns where a float32 copy of a chunk of
    half-precision W would pass 64 MiB. Square blocks keep both matmul operands small enough to stay in cache
    (measured on a 2-core CPU at N = 2048, H = 1024, V = 65 536: 2048 × 2048 blocks 1.78 s forward, 6.4 s forward +
    backward; 64 × 65 536 blocks, the same budget, 3.2 s and 9.8 s)."""
    budget = _BLOCK_ELEMENTS.get(device.type, _BLOCK_ELEMENTS["cpu"])
    if vocab_chunk_size is None:
        rows_hint = min(max(n_rows, 1), chunk_size if chunk_size is not None else math.isqrt(budget))
        columns = min(vocab, max(1024, budget // rows_hint))
        if weight_dtype != dtype:
            columns = min(columns, max(1, _WEIGHT_CHUNK_ELEMENTS // n_hidden))
    else:
        columns = min(vocab_chunk_size, vocab)
    rows = chunk_size if chunk_size is not None else max(1, budget // columns)
    return min(rows, max(n_rows, 1)), columns


class _FusedLinearStatistics(torch.autograd.Function):
    """(hidden [N, H], weight [V, H], ids [N]) → (log π [N], H [N], Σπ² [N]) in the compute dtype."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float, rows: int,
                columns: int, dtype: torch.dtype):
        with torch.autocast(hidden.device.type, enabled=False):     # the matmuls stay in the compute dtype
            return _FusedLinearStatistics._forward(ctx, hidden, weight, ids, temperature, rows, columns, dtype)

    @staticmethod
    def _forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, temperature: float, rows: int,
                 columns: int, dtype: torch.dtype):
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        scale = 1.0 / temperature
        peak = torch.full((n_rows,), -math.inf, dtype=dtype, device=device)
        s1 = torch.zeros(n_rows, dtype=dtype, device=device)
        s2 = torch.zeros_like(s1)
        tilt = torch.zeros_like(s1)                      # T = Σ e^{z − m}(z − m) ≤ 0
        chosen = torch.full_like(s1, math.nan)           # z_y; stays NaN for an id outside [0, V) (unchecked)
        block = torch.empty(min(rows, n_rows) * columns, dtype=dtype, device=device)
        native = _native.fused_usable(device, dtype)
        half = dtype == torch.float32 and _half_products(device, hidden, weight)
        exps = None if native else torch.empty_like(block)
        for start in range(0, vocab, columns):
            stop = min(start + columns, vocab)
            width = stop - start
            w_chunk = weight[start:stop] if half else weight[start:stop].to(dtype)
            local_ids = ids - start
            for first in range(0, n_rows, rows):
                last = min(first + rows, n_rows)
                count = last - first
                z = block[:count * width].view(count, width)
                _block_logits(z, hidden[first:last], w_chunk, scale, half=half)          # z = h·Wᵀ/τ
                mine = local_ids[first:last]
                inside = (mine >= 0) & (mine < width)
                picked = z.gather(1, mine.clamp(0, width - 1)[:, None])[:, 0]
                chosen[first:last] = torch.where(inside, picked, chosen[first:last])
                if native:                               # m, S₁, S₂, T updated in one native pass per row
                    _native.fused_fold(z, peak[first:last], s1[first:last], s2[first:last], tilt[first:last],
                                       first=start == 0)
                    continue
                a = exps[:count * width].view(count, width)
                old = peak[first:last]
                new = torch.maximum(old, z.amax(1))
                z.sub_(new[:, None])
                torch.exp(z, out=a)
                if start == 0:
                    s1[first:last] = a.sum(1)
                    s2[first:last] = _row_dot(a, a)
                    tilt[first:last] = _row_dot(a, z)
                else:                                    # rescale the running sums to the new maximum
                    shift = old - new
                    factor = torch.exp(shift)
                    tilt[first:last] = factor * (tilt[first:last] + shift * s1[first:last]) + _row_dot(a, z)
                    s1[first:last] = factor * s1[first:last] + a.sum(1)
                    s2[first:last] = factor * factor * s2[first:last] + _row_dot(a, a)
                peak[first:last] = new
        log_total = torch.log(s1)
        lse = peak + log_total
        log_probs = chosen - lse
        entropy = log_total - tilt / s1
        spp = s2 / torch.square(s1)
        ctx.save_for_backward(hidden, weight, ids, lse, entropy)
        ctx.configuration = (temperature, rows, columns, dtype)
        ctx.mark_non_differentiable(spp)
        return log_probs, entropy, spp

    @staticmethod
    @once_differentiable       # the blocks are rewritten in place: a second derivative through them would be wrong
    def backward(ctx, g_log_probs: torch.Tensor | None, g_entropy: torch.Tensor | None, _g_spp: Any):
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            return _FusedLinearStatistics._backward(ctx, g_log_probs, g_entropy)

    @staticmethod
    def _backward(ctx, g_log_probs: torch.Tensor | None, g_entropy: torch.Tensor | None):
        hidden, weight, ids, lse, entropy = ctx.saved_tensors
        temperature, rows, columns, dtype = ctx.configuration
        want_hidden, want_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if g_log_probs is None and g_entropy is None or not (want_hidden or want_weight):
            return None, None, None, None, None, None, None
        n_rows, vocab = hidden.shape[0], weight.shape[0]
        device = hidden.device
        scale = 1.0 / temperature
        g_lp = None if g_log_probs is None else g_log_probs.to(dtype)
        g_h = None if g_entropy is None else g_entropy.to(dtype)
        d_hidden = torch.zeros(hidden.shape, dtype=dtype, device=device) if want_hidden else None
        d_weight = torch.zeros(weight.shape, dtype=dtype, device=device) if want_weight else None
        block = torch.empty(min(rows, n_rows) * columns, dtype=dtype, device=device)
        native = _native.fused_usable(device, dtype)
        half = dtype == torch.float32 and _half_products(device, hidden, weight)     # the recomputed z only
        probs = None if native else torch.empty_like(block)
        if g_h is not None:
            offset = entropy * g_h if g_lp is None else g_lp + entropy * g_h     # c = g_lp + g_H·(log π + H)
        if native:                                       # c = offset + slope·log π_v, contiguous per-row values
            offset_rows = (g_lp if g_h is None else offset).contiguous()
            slope_rows = None if g_h is None else g_h.contiguous()
        neg_lse = -lse
        for start in range(0, vocab, columns):
            stop = min(start + columns, vocab)
            width = stop - start
            w_chunk = weight[start:stop].to(dtype)                             # a view unless W is half
            w_logits = weight[start:stop] if half else w_chunk
            for first in range(0, n_rows, rows):
                last = min(first + rows, n_rows)
                count = last - first
                z = block[:count * width].view(count, width)
                h = hidden[first:last].to(dtype)                               # a view unless h is half
                h_logits = hidden[first:last] if half else h
                if native:                                                     # z ← c·π, one native pass
                    _block_logits(z, h_logits, w_logits, scale, half=half)     # h·Wᵀ/τ (− lse in the pass)
                    _native.fused_cotangent(z, neg_lse[first:last], offset_rows[first:last],
                                            None if slope_rows is None else slope_rows[first:last])
                    product = z
                else:
                    z.copy_(neg_lse[first:last, None].expand(count, width))
                    _block_logits(z, h_logits, w_logits, scale, half=half, accumulate=True)     # log π_v = h·Wᵀ/τ − lse
                    p = probs[:count * width].view(count, width)
                    torch.exp(z, out=p)
                    if g_h is None:
                        p.mul_(g_lp[first:last, None])                         # c·π with c = g_lp
                        product = p
                    else:                                                      # c = offset + g_H·log π
                        torch.addcmul(offset[first:last, None], z, g_h[first:last, None], out=z).mul_(p)
                        product = z                                            # c·π
                if d_hidden is not None:
                    d_hidden[first:last].addmm_(product, w_chunk, alpha=-scale)
                if d_weight is not None:
                    d_weight[start:stop].addmm_(product.t(), h, alpha=-scale)
        if g_lp is not None:     # + g_lp·e_y, by row blocks of ≤ rows and ≤ 2¹⁸ values ([step, H] temporaries: 1 MiB)
            inside = (ids >= 0) & (ids < vocab)                  # an id outside [0, V) (unchecked) has no e_y term
            safe_ids = ids.clamp(0, vocab - 1)
            step = max(1, min(rows, _GATHER_ELEMENTS // hidden.shape[1]))
            for first in range(0, n_rows, step):
                last = min(first + step, n_rows)
                weighted = torch.where(inside[first:last], g_lp[first:last] * scale, 0.0)[:, None]
                if d_hidden is not None:
                    d_hidden[first:last].add_(weight.index_select(0, safe_ids[first:last]).to(dtype) * weighted)
                if d_weight is not None:
                    d_weight.index_add_(0, safe_ids[first:last], hidden[first:last].to(dtype) * weighted)
        return (None if d_hidden is None else d_hidden.to(hidden.dtype),
                None if d_weight is None else d_weight.to(weight.dtype), None, None, None, None, None)


def fused_linear_token_statistics(hidden: torch.Tensor, weight: torch.Tensor, token_ids: Any, *,
                                  temperature: Any = 1.0, chunk_size: int | None = None,
                                  vocab_chunk_size: int | None = None, check_values: bool = True) -> TokenStatistics:
    """log π(y), entropy and Σπ² of softmax(h·Wᵀ/τ) without materialising the logits; the port of
    :func:`otb_spec.token_statistics_from_hidden`.

    Args:
      hidden: [..., H] hidden states (float32, float64, bfloat16 or float16; may require grad).
      weight: [V, H] the LM head (``lm_head.weight``; may require grad), on hidden's device.
      token_ids: [...] integer ids of the sampled tokens, in [0, V) (any integer dtype). There is no
        ``ignore_index``: give positions you will mask out (HF's −100 labels) any id in [0, V), e.g. the padding
        token's, and mask their statistics afterwards.
      temperature: τ > 0; the logits are h·Wᵀ/τ.
      chunk_size: tokens per block (default: a fixed budget of values per block divided by its columns).
      vocab_chunk_size: vocabulary columns per block (default: square blocks of the budget, √budget columns — 2048 on
        CPU, 8192 on CUDA — or more when there are fewer tokens; at most what keeps a float32 copy of a chunk of a
        half-precision W within 64 MiB).
      check_values: reject NaN/±inf in hidden or weight (from each one's minimum and maximum: one read of each, no
        temporary) and ids outside [0, V) (one host synchronisation each), and finite inputs whose logits overflow the
        compute dtype (NaN statistics; a third synchronisation, over two per-token arrays, only where the inputs'
        extremes allow an overflow: 2V·H·max|h|·max|W|·max(1, 1/τ) beyond the dtype's largest number). Without it, NaN
        or ±inf inputs propagate and an id outside [0, V) gives log π = NaN there (its e_y term is left out of the
        gradient), as otb_jax's under a trace. Shapes, dtypes, devices and τ (also: 1/τ finite in the compute dtype; a τ
        tensor that requires grad is refused — no gradient with respect to τ here) are always checked.

    Returns:
      :class:`TokenStatistics` (log_probs, entropy, sum_pi_squared), each [...] in float32 (float64 for float64
      inputs). log_probs and entropy carry exact gradients with respect to hidden and weight (a custom autograd
      Function whose backward also works block by block; once differentiable: a second derivative raises);
      sum_pi_squared is detached.

    Raises:
      ValueError / TypeError naming ``hidden``, ``weight``, ``token_ids``, ``temperature``, ``chunk_size`` or
      ``vocab_chunk_size``.
    """
    hidden = _float_tensor("hidden", hidden)
    weight = _float_tensor("weight", weight)
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"hidden: expected shape [..., H] with H ≥ 1, got {tuple(hidden.shape)}")
    if weight.dim() != 2 or weight.shape[0] == 0:
        raise ValueError(f"weight: expected shape [V, H] with V ≥ 1 (the LM head, as torch.nn.Linear stores it), got "
                         f"{tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight: expected shape [V, {hidden.shape[-1]}] (H = hidden.shape[-1] = {hidden.shape[-1]}), "
                         f"got {tuple(weight.shape)}")
    if weight.device != hidden.device:
        raise ValueError(f"weight: on {weight.device} but hidden is on {hidden.device}")
    tau = _temperature(temperature)
    rows_option = _positive_int("chunk_size", chunk_size)
    columns_option = _positive_int("vocab_chunk_size", vocab_chunk_size)
    lead = tuple(hidden.shape[:-1])
    vocab = weight.shape[0]
    ids = checked_token_ids(token_ids, lead, vocab, hidden.device, check_values, source="hidden").reshape(-1)
    dtype = _compute_dtype(hidden, weight)
    _check_reciprocal(tau, dtype)
    may_overflow = False
    if check_values and hidden.numel():     # min and max of each input: one read of each, no temporary of its size,
        extremes = torch.stack([torch.stack(torch.aminmax(value.detach())).to(torch.float64)   # one synchronisation
                                for value in (hidden, weight)]).tolist()
        if not all(math.isfinite(value) for pair in extremes for value in pair):     # NaN or ±inf shows there
            _first_bad("hidden", hidden)
            _first_bad("weight", weight)
        may_overflow = _may_overflow(extremes, hidden.shape[-1], vocab, tau, dtype)
    flat = hidden.reshape(-1, hidden.shape[-1])
    rows, columns = _blocks(flat.shape[0], vocab, hidden.device, dtype, weight.dtype, hidden.shape[-1], rows_option,
                            columns_option)
    log_probs, entropy, spp = _FusedLinearStatistics.apply(flat, weight, ids, tau, rows, columns, dtype)
    if may_overflow:
        _check_finite_statistics(log_probs, entropy, dtype)
    return TokenStatistics(log_probs.reshape(lead), entropy.reshape(lead), spp.reshape(lead))
