"""otb_torch.fused_linear_token_statistics: log π, entropy and Σπ² from hidden states and the LM head without the
logits, equal to the reference (values and gradients, against the analytic formulas) within the derived bounds."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import otb_spec as otb
from otb_spec import strategies as otb_st
from otb_spec.tolerances import hidden_comparison_tolerances

torch = pytest.importorskip("torch")
otb_torch = pytest.importorskip("otb_torch")

from otb_torch import _native  # noqa: E402
from accelerators import requires_cuda  # noqa: E402

KERNELS = ["native", "eager"]     # the float32 elementwise work in the native kernel (where built), or in torch ops
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _run(case: otb_st.LMHeadCase, dtype: torch.dtype, *, chunk_size=None, vocab_chunk_size=None,
         use_log_probs: bool = True, use_entropy: bool = True, kernel: str = "native", device: str = "cpu"):
    """The port on ``case`` (cast to ``dtype``, on ``device``): its statistics and the gradients of
    Σ g_lp·log π + g_H·H, forward and backward with the native elementwise kernel where it serves (float32 on CPU)
    or, ``kernel="eager"``, the torch fallback. Returned on the CPU."""
    hidden = torch.tensor(case.hidden, dtype=dtype, device=device, requires_grad=True)
    weight = torch.tensor(case.weight, dtype=dtype, device=device, requires_grad=True)
    with _native.eager_only() if kernel == "eager" else contextlib.nullcontext():
        stats = otb_torch.fused_linear_token_statistics(hidden, weight, torch.tensor(case.token_ids, device=device),
                                                        temperature=case.temperature, chunk_size=chunk_size,
                                                        vocab_chunk_size=vocab_chunk_size)
        loss = 0 * stats.log_probs.sum()
        if use_log_probs:
            loss = loss + (stats.log_probs * torch.tensor(case.log_probs_cotangent, dtype=stats.log_probs.dtype,
                                                          device=device)).sum()
        if use_entropy:
            loss = loss + (stats.entropy * torch.tensor(case.entropy_cotangent, dtype=stats.entropy.dtype,
                                                        device=device)).sum()
        loss.backward()
    assert stats.log_probs.device.type == hidden.grad.device.type == weight.grad.device.type == device
    if device != "cpu":
        stats = type(stats)(*(value.cpu() for value in stats))
        hidden, weight = (_on_cpu(tensor) for tensor in (hidden, weight))
    return stats, hidden, weight


def _on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU copy of a leaf tensor and of its gradient."""
    copy = tensor.detach().cpu().requires_grad_(True)
    copy.grad = tensor.grad.cpu()
    return copy


def _assert_matches_reference(case, dtype, stats, hidden, weight, *, use_log_probs=True, use_entropy=True):
    exact_hidden = hidden.detach().double().numpy()     # the values the port was given, exactly
    exact_weight = weight.detach().double().numpy()
    g_lp = case.log_probs_cotangent if use_log_probs else None
    g_h = case.entropy_cotangent if use_entropy else None
    reference = otb.token_statistics_from_hidden(exact_hidden, exact_weight, case.token_ids,
                                                 temperature=case.temperature)
    gradients = otb.token_statistics_vjp(exact_hidden, exact_weight, case.token_ids, g_lp, g_h,
                                         temperature=case.temperature)
    compute = "float64" if dtype == torch.float64 else "float32"
    # the port works in float32 on half-precision inputs (their products are exact in float32, whether it upcasts
    # them or multiplies them into float32): its bound is float32's, plus the gradients' rounding to the inputs' dtype
    statistics, (bound_h, bound_w) = hidden_comparison_tolerances(
        exact_hidden, exact_weight, case.token_ids, temperature=case.temperature, log_probs_cotangent=g_lp,
        entropy_cotangent=g_h, input_dtype=compute, output_dtype=str(dtype).split(".")[1])
    for name in ("log_probs", "entropy", "sum_pi_squared"):
        value = getattr(stats, name)
        assert value.dtype == DTYPES[compute] and tuple(value.shape) == case.token_ids.shape, name
        getattr(statistics, name).assert_close(value.detach().numpy(), getattr(reference, name), name)
    assert not stats.sum_pi_squared.requires_grad
    assert hidden.grad.dtype == dtype and weight.grad.dtype == dtype
    bound_h.assert_close(hidden.grad.double().numpy(), gradients.hidden, "∂hidden vs the analytic VJP")
    bound_w.assert_close(weight.grad.double().numpy(), gradients.weight, "∂weight vs the analytic VJP")


blocks = st.tuples(st.one_of(st.none(), st.integers(1, 9)), st.one_of(st.none(), st.integers(1, 40)))


@pytest.mark.parametrize("kernel", KERNELS)
@given(case=otb_st.lm_head_inputs(), dtype=st.sampled_from(["float32", "float64"]), block=blocks)
def test_values_and_gradients_equal_the_reference(case, dtype, block, kernel):
    """For any row and vocabulary chunking (online rescaling across vocabulary chunks included)."""
    stats, hidden, weight = _run(case, DTYPES[dtype], chunk_size=block[0], vocab_chunk_size=block[1], kernel=kernel)
    _assert_matches_reference(case, DTYPES[dtype], stats, hidden, weight)


@given(case=otb_st.lm_head_inputs(max_vocab_size=40, max_hidden_size=12), dtype=st.sampled_from(["bfloat16", "float16"]),
       block=blocks, kernel=st.sampled_from(KERNELS))
def test_half_precision_inputs_are_accumulated_in_float32(case, dtype, block, kernel):
    """bf16/fp16 hidden states and weights: statistics in float32 with float32's bound (not the half precision's)."""
    stats, hidden, weight = _run(case, DTYPES[dtype], chunk_size=block[0], vocab_chunk_size=block[1], kernel=kernel)
    _assert_matches_reference(case, DTYPES[dtype], stats, hidden, weight)


@given(case=otb_st.lm_head_inputs(lead_shapes=[(3, 4)]), use_log_probs=st.booleans(),
       dtype=st.sampled_from(["float32", "float64"]), kernel=st.sampled_from(KERNELS))
def test_a_loss_of_one_statistic_gets_its_own_gradient(case, use_log_probs, dtype, kernel):
    """Only log π in the loss (a policy loss without entropy bonus) or only the entropy: the backward pass takes
    the matching branch (the other cotangent is None)."""
    use_entropy = not use_log_probs
    stats, hidden, weight = _run(case, DTYPES[dtype], chunk_size=5, vocab_chunk_size=7, use_log_probs=use_log_probs,
                                 use_entropy=use_entropy, kernel=kernel)
    _assert_matches_reference(case, DTYPES[dtype], stats, hidden, weight, use_log_probs=use_log_probs,
                              use_entropy=use_entropy)


def test_gradcheck_in_float64():
    """torch.autograd.gradcheck: the custom backward agrees with finite differences of the custom forward."""
    rng = np.random.default_rng(0)
    hidden = torch.tensor(rng.normal(size=(5, 3)), requires_grad=True)
    weight = torch.tensor(rng.normal(size=(11, 3)), requires_grad=True)
    ids = torch.tensor(rng.integers(0, 11, 5))

    def both(h, w):
        stats = otb_torch.fused_linear_token_statistics(h, w, ids, temperature=0.7, chunk_size=2, vocab_chunk_size=4)
        return stats.log_probs, stats.entropy

    assert torch.autograd.gradcheck(both, (hidden, weight))


def test_only_the_gradients_asked_for_are_computed():
    rng = np.random.default_rng(1)
    hidden = torch.tensor(rng.normal(size=(4, 3)), dtype=torch.float32, requires_grad=True)
    weight = torch.tensor(rng.normal(size=(9, 3)), dtype=torch.float32)          # a frozen LM head
    stats = otb_torch.fused_linear_token_statistics(hidden, weight, torch.tensor([0, 3, 8, 2]))
    stats.log_probs.sum().backward()
    assert hidden.grad is not None and weight.grad is None
    with torch.no_grad():
        frozen = otb_torch.fused_linear_token_statistics(hidden, weight, torch.tensor([0, 3, 8, 2]))
    assert not frozen.log_probs.requires_grad
    torch.testing.assert_close(frozen.log_probs, stats.log_probs.detach(), rtol=0, atol=0)


@given(case=otb_st.lm_head_inputs(lead_shapes=[(6,)], max_vocab_size=50))
def test_autocast_does_not_lower_the_precision(case):
    """Under torch.autocast (verl's forward_step runs the model under it) the matmuls stay in float32."""
    hidden = torch.tensor(case.hidden, dtype=torch.float32)
    weight = torch.tensor(case.weight, dtype=torch.float32)
    plain = otb_torch.fused_linear_token_statistics(hidden, weight, torch.tensor(case.token_ids))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast = otb_torch.fused_linear_token_statistics(hidden, weight, torch.tensor(case.token_ids))
    for name in ("log_probs", "entropy", "sum_pi_squared"):
        torch.testing.assert_close(getattr(autocast, name), getattr(plain, name), rtol=0, atol=0)


def test_inputs_are_not_modified_and_empty_batches_work():
    rng = np.random.default_rng(2)
    hidden = torch.tensor(rng.normal(size=(2, 3, 4)), dtype=torch.float32, requires_grad=True)
    weight = torch.tensor(rng.normal(size=(6, 4)), dtype=torch.float32, requires_grad=True)
    ids = torch.tensor(rng.integers(0, 6, (2, 3)))
    copies = hidden.detach().clone(), weight.detach().clone(), ids.clone()
    stats = otb_torch.fused_linear_token_statistics(hidden, weight, ids, temperature=torch.tensor(0.5))
    (stats.log_probs.sum() + stats.entropy.sum()).backward()
    for before, after in zip(copies, (hidden.detach(), weight.detach(), ids)):
        torch.testing.assert_close(before, after, rtol=0, atol=0)
    empty = otb_torch.fused_linear_token_statistics(torch.zeros(0, 4, requires_grad=True), weight,
                                                    torch.zeros(0, dtype=torch.int64))
    assert empty.log_probs.shape == (0,)
    empty.log_probs.sum().backward()


@pytest.mark.parametrize("change, match", [
    (dict(weight=torch.ones(5, 3)), "weight: expected shape \\[V, 4\\]"),
    (dict(weight=torch.ones(5)), "weight: expected shape \\[V, H\\]"),
    (dict(token_ids=torch.zeros(3, dtype=torch.int64)), "token_ids: expected shape \\(2,\\) \\(hidden without"),
    (dict(token_ids=torch.tensor([0, 6])), "token_ids: must lie in \\[0, 6\\)"),
    (dict(token_ids=torch.tensor([-1, 0])), "token_ids: must lie in \\[0, 6\\)"),
    (dict(hidden=torch.tensor([[0.0, float("nan"), 0.0, 0.0]] * 2)), "hidden: contains NaN or ±inf"),
    (dict(weight=torch.full((6, 4), float("inf"))), "weight: contains NaN or ±inf"),
    (dict(temperature=0.0), "temperature: must be > 0"),
    (dict(temperature=-2.0), "temperature: must be > 0"),
    (dict(temperature=float("inf")), "temperature: must be finite"),
    (dict(chunk_size=0), "chunk_size: expected a positive integer"),
    (dict(vocab_chunk_size=2.5), "vocab_chunk_size: expected a positive integer"),
    (dict(temperature=1e-40), "temperature: τ = 1e-40 is too small for torch.float32 logits"),
    (dict(temperature=torch.tensor(0.5, requires_grad=True)), "temperature: a tensor that requires grad"),
    (dict(hidden=torch.full((2, 4), 1e38)), "hidden: with weight and temperature, the logits h·Wᵀ/τ overflow"),
])
def test_bad_input_raises_naming_the_argument(change, match):
    arguments = dict(hidden=torch.ones(2, 4), weight=torch.ones(6, 4), token_ids=torch.tensor([0, 5]))
    options = {key: change.pop(key) for key in ("temperature", "chunk_size", "vocab_chunk_size") if key in change}
    arguments.update(change)
    with pytest.raises(ValueError, match=match):
        otb_torch.fused_linear_token_statistics(arguments["hidden"], arguments["weight"], arguments["token_ids"],
                                                **options)


def test_bad_types_raise_naming_the_argument():
    with pytest.raises(TypeError, match="hidden: expected a torch.Tensor"):
        otb_torch.fused_linear_token_statistics(np.ones((2, 4)), torch.ones(6, 4), torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="weight: expected a floating tensor"):
        otb_torch.fused_linear_token_statistics(torch.ones(2, 4), torch.ones(6, 4, dtype=torch.int64),
                                                torch.tensor([0, 1]))
    with pytest.raises(TypeError, match="token_ids: expected integer token ids"):
        otb_torch.fused_linear_token_statistics(torch.ones(2, 4), torch.ones(6, 4), torch.tensor([0.0, 1.0]))
    with pytest.raises(TypeError, match="temperature: expected a real number, got a bool"):
        otb_torch.fused_linear_token_statistics(torch.ones(2, 4), torch.ones(6, 4), torch.tensor([0, 1]),
                                                temperature=True)


@pytest.mark.parametrize("dtype, vocab, token", [(torch.uint8, 300, 200), (torch.int16, 40_000, 30_000),
                                                  (torch.int32, 300, 299)])
def test_narrow_integer_token_ids_are_read_as_their_values(dtype, vocab, token):
    """Comparing ids with V in their own dtype would wrap V (300 is 44 in uint8) and reject valid ids."""
    rng = np.random.default_rng(5)
    hidden = torch.tensor(rng.normal(size=(3, 4)), dtype=torch.float32)
    weight = torch.tensor(rng.normal(size=(vocab, 4)), dtype=torch.float32)
    wide = torch.tensor([1, 2, token])
    expected = otb_torch.fused_linear_token_statistics(hidden, weight, wide)
    got = otb_torch.fused_linear_token_statistics(hidden, weight, wide.to(dtype))
    from_logits = otb_torch.token_statistics_from_logits(hidden @ weight.t(), wide.to(dtype))
    torch.testing.assert_close(got.log_probs, expected.log_probs, rtol=0, atol=0)
    torch.testing.assert_close(from_logits.log_probs, expected.log_probs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", KERNELS)
def test_unchecked_ids_outside_the_vocabulary_give_nan_and_no_gradient_term(kernel):
    """check_values=False: log π = NaN at an id outside [0, V) (never a finite number, never an index error in the
    backward pass); the other statistics and the other tokens are unchanged. A loss that leaves those tokens' log π
    out gets the gradient it gets with valid ids there, bit for bit; one that keeps them gets the gradient without
    their e_y term (−g·π only: log π as if z_y were absent), as otb_jax's under a trace."""
    rng = np.random.default_rng(6)
    hidden = torch.tensor(rng.normal(size=(4, 3)), dtype=torch.float32, requires_grad=True)
    weight = torch.tensor(rng.normal(size=(7, 3)), dtype=torch.float32, requires_grad=True)
    good, bad = torch.tensor([1, 2, 3, 4]), torch.tensor([1, 7, 3, -2])
    logits = hidden.detach() @ weight.detach().t()
    with pytest.raises(ValueError, match=r"token_ids: must lie in \[0, 7\)"):
        otb_torch.token_statistics_from_logits(logits, bad)
    unchecked = otb_torch.token_statistics_from_logits(logits, bad, check_values=False)
    assert torch.isnan(unchecked.log_probs[[1, 3]]).all() and torch.isfinite(unchecked.log_probs[[0, 2]]).all()
    valid = torch.tensor([True, False, True, False])
    coefficients = torch.tensor([1.0, 0.5, -2.0, 0.25])
    with _native.eager_only() if kernel == "eager" else contextlib.nullcontext():
        reference = otb_torch.fused_linear_token_statistics(hidden, weight, good)
        out = otb_torch.fused_linear_token_statistics(hidden, weight, bad, check_values=False)
        assert torch.isnan(out.log_probs[[1, 3]]).all()
        for name in ("entropy", "sum_pi_squared"):
            torch.testing.assert_close(getattr(out, name), getattr(reference, name), rtol=0, atol=0)
        torch.testing.assert_close(out.log_probs[valid], reference.log_probs[valid], rtol=0, atol=0)
        grads = [torch.autograd.grad((torch.where(valid, stats.log_probs, 0.0) * coefficients).sum()
                                     + stats.entropy.sum(), (hidden, weight)) for stats in (out, reference)]
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # kept in the loss (float64, eager): the gradient of Σ g·(−lse) at those tokens, by autograd on explicit logits
    hidden64, weight64 = (tensor.detach().double().requires_grad_(True) for tensor in (hidden, weight))
    out = otb_torch.fused_linear_token_statistics(hidden64, weight64, bad, check_values=False)
    got = torch.autograd.grad(out.log_probs, (hidden64, weight64), coefficients.double())     # NaN values, g ≠ 0
    z = hidden64 @ weight64.t()
    lse = torch.logsumexp(z, -1)
    explicit = torch.where(valid, z.gather(1, good[:, None])[:, 0] - lse, -lse)
    want = torch.autograd.grad((explicit * coefficients.double()).sum(), (hidden64, weight64))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def test_a_second_derivative_raises_instead_of_a_wrong_value():
    """The backward rewrites its blocks in place (once differentiable): differentiating the gradient again is an
    error, not the second derivative of h·Wᵀ/τ that autograd would otherwise record."""
    rng = np.random.default_rng(7)
    hidden = torch.tensor(rng.normal(size=(3, 4)), dtype=torch.float32, requires_grad=True)
    weight = torch.tensor(rng.normal(size=(9, 4)), dtype=torch.float32)
    stats = otb_torch.fused_linear_token_statistics(hidden, weight, torch.tensor([0, 4, 8]))
    (gradient,) = torch.autograd.grad(stats.log_probs.sum() + stats.entropy.sum(), hidden, create_graph=True)
    assert not gradient.requires_grad                     # no graph recorded through the backward pass
    with pytest.raises(RuntimeError, match="does not require grad"):
        torch.autograd.grad((gradient ** 2).sum(), hidden)
    cotangent = torch.ones(3, requires_grad=True)          # a cotangent that requires grad: the error says why
    (gradient,) = torch.autograd.grad(stats.log_probs, hidden, cotangent, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (gradient ** 2).sum().backward()


def test_the_overflow_check_after_the_forward_runs_only_where_the_extremes_allow_an_overflow():
    """The third host synchronisation is skipped where 2V·H·max|h|·max|W|·max(1, 1/τ) stays below the compute dtype's
    largest number (no logit, partial sum or running sum can overflow there): a realistic LM head never pays it."""
    from otb_torch._fused import _may_overflow

    realistic = [[-60.0, 80.0], [-0.5, 0.4]]                     # hidden states, LM head weights
    assert not _may_overflow(realistic, 8192, 152_064, 0.6, torch.float32)
    assert _may_overflow([[-1e30, 1e30], [-1e6, 1e6]], 8192, 152_064, 1.0, torch.float32)
    assert not _may_overflow([[-1e30, 1e30], [-1e6, 1e6]], 8192, 152_064, 1.0, torch.float64)
    assert _may_overflow(realistic, 8192, 152_064, 1e-33, torch.float32)       # a tiny τ scales every logit


def test_numpy_integer_chunk_sizes_are_accepted():
    hidden, weight, ids = torch.ones(5, 4), torch.ones(11, 4), torch.tensor([0, 1, 2, 3, 10])
    expected = otb_torch.fused_linear_token_statistics(hidden, weight, ids, chunk_size=2, vocab_chunk_size=3)
    got = otb_torch.fused_linear_token_statistics(hidden, weight, ids, chunk_size=np.int64(2),
                                                  vocab_chunk_size=np.int32(3))
    torch.testing.assert_close(got.entropy, expected.entropy, rtol=0, atol=0)


# ----------------------------------------------------------------------------------------------------------------------
# CUDA (skipped cleanly without a GPU): the same bounds as on the CPU under torch's default float32 matmul precision
# (no TF32; the port follows the caller's setting and adds none of its own)


@contextlib.contextmanager
def _float32_matmuls():
    """torch's default float32 matmul precision ("highest", no TF32) for the test, whatever was set before it."""
    precision, tf32 = torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32
    torch.set_float32_matmul_precision("highest")
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(precision)
        torch.backends.cuda.matmul.allow_tf32 = tf32


@pytest.mark.gpu
@requires_cuda
@settings(max_examples=40, deadline=None)
@given(case=otb_st.lm_head_inputs(), dtype=st.sampled_from(["float32", "float64", "bfloat16", "float16"]),
       block=blocks)
def test_cuda_values_and_gradients_equal_the_reference(case, dtype, block):
    """bf16/fp16: the logits' blocks multiply the half-precision operands themselves into float32 (tensor cores,
    where this torch has the matmuls' ``out_dtype``), under the same float32 bound as the upcast operands."""
    with _float32_matmuls():
        stats, hidden, weight = _run(case, DTYPES[dtype], chunk_size=block[0], vocab_chunk_size=block[1],
                                     device="cuda")
    _assert_matches_reference(case, DTYPES[dtype], stats, hidden, weight)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_half_precision_operands_multiply_without_an_upcast_copy(dtype):
    """Where this torch's CUDA matmul takes half-precision operands into a float32 result (``out_dtype``), the fused
    statistics use it — so the half-precision CUDA cases of the value tests run that path, not the upcast."""
    hidden = torch.ones((3, 4), dtype=dtype, device="cuda")
    weight = torch.ones((5, 4), dtype=dtype, device="cuda")
    block = torch.empty((3, 5), dtype=torch.float32, device="cuda")
    try:
        torch.addmm(block, hidden, weight.t(), beta=0, out_dtype=torch.float32, out=block)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        pytest.skip(f"torch {torch.__version__} has no float32-output CUDA matmul of {dtype} operands: {exc}")
    assert otb_torch._fused._half_products(hidden.device, hidden, weight)
    assert not otb_torch._fused._half_products(hidden.device, hidden, weight.float())     # mixed dtypes: upcast


def test_half_precision_operands_are_upcast_on_the_cpu(monkeypatch):
    """The half-precision products are CUDA's only: on the CPU (where torch 2.13 has no float32-output matmul of bf16
    operands) the fused statistics multiply float32 copies — every CPU test of half-precision inputs checks that path —
    and never probe torch for the other."""
    asked = []
    monkeypatch.setattr(otb_torch._fused, "_HALF_PRODUCTS", _Recording(asked))
    hidden = torch.ones((3, 4), dtype=torch.bfloat16)
    weight = torch.ones((5, 4), dtype=torch.bfloat16)
    assert not otb_torch._fused._half_products(hidden.device, hidden, weight)
    stats = otb_torch.fused_linear_token_statistics(hidden, weight, torch.tensor([0, 1, 4]))
    assert stats.log_probs.dtype == torch.float32 and asked == []


class _Recording(dict):
    """A probe cache that records every key looked up in it."""

    def __init__(self, asked: list):
        super().__init__()
        self.asked = asked

    def __contains__(self, key):
        self.asked.append(key)
        return super().__contains__(key)


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_default_blocks_at_a_realistic_size_equal_the_reference(dtype):
    """N·V = 1100 × 65600 > 2²⁶ (CUDA's block budget): several default blocks, vocabulary not a power of two, hidden
    states N(0, 1) and weights N(0, 0.02²) (logits ~1, a trained model's scale), both exact in float32 (in bfloat16,
    rounded to it: the reference is given the rounded values)."""
    generator = np.random.default_rng(23)
    tokens, hidden_size, vocab = 1100, 64, 65600
    case = otb_st.LMHeadCase(
        hidden=generator.standard_normal((tokens, hidden_size)).astype(np.float32).astype(np.float64),
        weight=(0.02 * generator.standard_normal((vocab, hidden_size))).astype(np.float32).astype(np.float64),
        token_ids=generator.integers(0, vocab, tokens), temperature=0.7,
        log_probs_cotangent=generator.standard_normal(tokens),
        entropy_cotangent=0.01 * generator.standard_normal(tokens))
    rows, columns = otb_torch._fused._blocks(tokens, vocab, torch.device("cuda"), torch.float32, dtype,
                                             hidden_size, None, None)
    assert rows * columns < tokens * vocab                            # more than one block: the online rescaling runs
    with _float32_matmuls():
        stats, hidden, weight = _run(case, dtype, device="cuda")
    _assert_matches_reference(case, dtype, stats, hidden, weight)
