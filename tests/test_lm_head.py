"""Token statistics from hidden states and the LM head: the definition fused-linear kernels implement, its analytic
gradients, and the error bounds that judge implementations (otb_spec.lm_head, otb_spec.tolerances)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import otb_spec as otb
from otb_spec import strategies as otb_st
from otb_spec.lm_head import lm_head_logits, logit_cotangent
from otb_spec.tolerances import (
    hidden_comparison_tolerances,
    hidden_gradient_tolerance,
    hidden_statistics_tolerance,
    summation_tolerance,
)

torch = pytest.importorskip("torch")

cases = otb_st.lm_head_inputs()


def _flat(case: otb_st.LMHeadCase) -> tuple[np.ndarray, np.ndarray]:
    return case.hidden.reshape(-1, case.hidden.shape[-1]), case.token_ids.reshape(-1)


# ----------------------------------------------------------------------------------------------------------------------
# the definition


@given(case=cases, chunk=st.one_of(st.none(), st.integers(1, 5)))
def test_statistics_from_hidden_are_those_of_the_lm_head_logits(case, chunk):
    """token_statistics_from_hidden(h, W, y, τ) = token_statistics_from_logits(h·Wᵀ/τ, y), for any chunking."""
    fused = otb.token_statistics_from_hidden(case.hidden, case.weight, case.token_ids, temperature=case.temperature,
                                             chunk_size=chunk)
    logits = otb.lm_head_logits(case.hidden, case.weight, temperature=case.temperature)
    plain = otb.token_statistics_from_logits(logits, case.token_ids)
    vocab = case.weight.shape[0]
    bound = summation_tolerance(vocab, 4 * float(np.abs(logits).max(initial=0.0)) + np.log(vocab) + 4)
    for name in ("log_probs", "entropy", "sum_pi_squared"):
        bound.assert_close(getattr(fused, name), getattr(plain, name), name)
        assert getattr(fused, name).shape == case.token_ids.shape


def test_worked_examples():
    """π = (¾, ¼): log π(0) = log ¾, H = −¾log¾ − ¼log¼, Σπ² = ⅝; τ divides the logits."""
    stats = otb.token_statistics_from_hidden([[np.log(3.0)]], [[1.0], [0.0]], [0])
    np.testing.assert_allclose([stats.log_probs[0], stats.entropy[0], stats.sum_pi_squared[0]],
                               [np.log(0.75), -0.75 * np.log(0.75) - 0.25 * np.log(0.25), 0.625], rtol=1e-15)
    hot = otb.token_statistics_from_hidden([[2 * np.log(3.0)]], [[1.0], [0.0]], [1], temperature=2.0)
    np.testing.assert_allclose(hot.log_probs, [np.log(0.25)], rtol=1e-15)


def test_inputs_are_not_modified():
    rng = np.random.default_rng(0)
    hidden, weight, ids = rng.normal(size=(3, 4)), rng.normal(size=(5, 4)), np.array([0, 4, 2])
    copies = hidden.copy(), weight.copy(), ids.copy()
    otb.token_statistics_from_hidden(hidden, weight, ids, temperature=0.5)
    otb.token_statistics_vjp(hidden, weight, ids, np.ones(3), np.ones(3), temperature=0.5)
    for before, after in zip(copies, (hidden, weight, ids)):
        np.testing.assert_array_equal(before, after)


# ----------------------------------------------------------------------------------------------------------------------
# the analytic gradients


@given(logits=otb_st.logits((3,), min_vocab_size=1, max_vocab_size=30, max_abs=20.0, allow_neg_inf=True))
def test_entropy_logit_gradient_is_the_derivative_of_the_entropy(logits):
    """∇_z H = −π ⊙ (log π + H), checked against the complex-step derivative of −Σ π log π (no cancellation), and
    it sums to 0 over the vocabulary (softmax is shift-invariant)."""
    analytic = otb.entropy_logit_gradient(logits)
    step = 1e-30
    numeric = np.zeros_like(analytic)
    finite = np.isfinite(logits)
    for v in range(logits.shape[-1]):
        perturbed = logits.astype(np.complex128)
        perturbed[:, v] += 1j * step
        shift = np.max(logits, axis=-1, keepdims=True)
        lse = shift + np.log(np.sum(np.exp(perturbed - shift), axis=-1, keepdims=True))
        log_probs = np.where(finite, perturbed - lse, 0.0)
        entropy = -np.sum(np.exp(log_probs) * log_probs * finite, axis=-1)
        numeric[:, v] = np.where(finite[:, v], np.imag(entropy) / step, 0.0)
    bound = summation_tolerance(logits.shape[-1] + 2, 4 * (float(np.abs(logits[finite]).max()) + 4))
    bound.assert_close(analytic, numeric, "∂H/∂z")
    summation_tolerance(logits.shape[-1], float(np.abs(analytic).sum(-1).max()) + 1).assert_close(
        analytic.sum(-1), np.zeros(3), "Σ_v ∂H/∂z_v")


@given(case=cases)
def test_vjp_is_the_chain_rule_through_the_lm_head(case):
    """token_statistics_vjp = (Σ_v ∂z·W/τ, Σₙ ∂zₙᵀhₙ/τ) with ∂z = g_lp·∇log π(y) + g_H·∇H from the two analytic
    logit gradients (otb.logit_gradient, otb.entropy_logit_gradient)."""
    hidden, ids = _flat(case)
    logits = hidden @ case.weight.T / case.temperature
    d_logits = (case.log_probs_cotangent.reshape(-1, 1) * otb.logit_gradient(logits, ids)
                + case.entropy_cotangent.reshape(-1, 1) * otb.entropy_logit_gradient(logits))
    gradients = otb.token_statistics_vjp(case.hidden, case.weight, case.token_ids, case.log_probs_cotangent,
                                         case.entropy_cotangent, temperature=case.temperature)
    assert gradients.hidden.shape == case.hidden.shape and gradients.weight.shape == case.weight.shape
    vocab, n_rows = case.weight.shape[0], hidden.shape[0]
    # ∂z from the two evaluations differs by rounding: a few operations per element on π, log π + H (a V-term sum)
    # and the cotangents, so by (V + 2)ε times Σₙ 2|g_lp| + |g_H|(2H + 1) ≥ Σ_v |∂z_v| — its own magnitude (h and W
    # may all be 0, and ∂z exactly 0 where π is uniform); the matmuls carry that, times |W| or |h|, on top of their sums
    entropy = otb.token_statistics_from_logits(logits, None).entropy
    z_magnitude = float(np.sum(2 * np.abs(case.log_probs_cotangent.reshape(-1))
                               + np.abs(case.entropy_cotangent.reshape(-1)) * (2 * entropy + 1)))
    magnitude = float((np.abs(d_logits).sum() + z_magnitude) * (np.abs(case.weight).max() + np.abs(hidden).max())
                      / case.temperature)
    bound = summation_tolerance(vocab + n_rows, magnitude + 1e-300)
    bound.assert_close(gradients.hidden.reshape(hidden.shape), d_logits @ case.weight / case.temperature, "∂hidden")
    bound.assert_close(gradients.weight, d_logits.T @ hidden / case.temperature, "∂weight")
    summation_tolerance(vocab + 2, z_magnitude + 1e-300).assert_close(
        logit_cotangent(logits, ids, case.log_probs_cotangent.reshape(-1), case.entropy_cotangent.reshape(-1)),
        d_logits, "∂z")


@given(case=otb_st.lm_head_inputs(lead_shapes=[(3,), (2, 2)], max_vocab_size=20, max_hidden_size=6))
def test_vjp_equals_float64_autograd_of_the_unfused_computation(case):
    """An independent derivation: torch autograd (float64) through logits = h·Wᵀ/τ, log_softmax, gather, −Σπ log π."""
    h = torch.tensor(case.hidden, requires_grad=True)
    w = torch.tensor(case.weight, requires_grad=True)
    log_probs = torch.log_softmax(h @ w.T / case.temperature, -1)
    chosen = log_probs.gather(-1, torch.tensor(case.token_ids)[..., None])[..., 0]
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    (chosen * torch.tensor(case.log_probs_cotangent) + entropy * torch.tensor(case.entropy_cotangent)).sum().backward()
    gradients = otb.token_statistics_vjp(case.hidden, case.weight, case.token_ids, case.log_probs_cotangent,
                                         case.entropy_cotangent, temperature=case.temperature)
    tolerance_h, tolerance_w = hidden_gradient_tolerance(case.hidden, case.weight, case.token_ids,
                                                         case.log_probs_cotangent, case.entropy_cotangent,
                                                         temperature=case.temperature, dtype=np.float64)
    (tolerance_h + tolerance_h).assert_close(h.grad.numpy(), gradients.hidden, "∂hidden vs autograd")
    (tolerance_w + tolerance_w).assert_close(w.grad.numpy(), gradients.weight, "∂weight vs autograd")


# ----------------------------------------------------------------------------------------------------------------------
# bad input: an error naming the argument


@pytest.mark.parametrize("hidden, weight, ids, temperature, match", [
    (np.ones((2, 3)), np.ones((4, 2)), [0, 1], 1.0, "weight: expected shape \\[V, 3\\]"),
    (np.ones((2, 3)), np.ones(4), [0, 1], 1.0, "weight: expected shape \\[V, H\\]"),
    (np.ones((2, 3)), np.ones((0, 3)), [0, 1], 1.0, "weight: the vocabulary axis is empty"),
    (np.ones((2, 0)), np.ones((4, 0)), [0, 1], 1.0, "hidden: the hidden axis is empty"),
    (np.ones((2, 3)), np.ones((4, 3)), [0, 1, 2], 1.0, "token_ids: expected shape \\(2,\\) \\(hidden without"),
    (np.ones((2, 3)), np.ones((4, 3)), [0, 4], 1.0, "token_ids: must lie in \\[0, 4\\)"),
    (np.ones((2, 3)), np.ones((4, 3)), [-1, 0], 1.0, "token_ids: must lie in \\[0, 4\\)"),
    (np.array([[1.0, np.nan, 0.0]] * 2), np.ones((4, 3)), [0, 1], 1.0, "hidden: contains NaN"),
    (np.ones((2, 3)), np.full((4, 3), np.inf), [0, 1], 1.0, "weight: contains NaN or ±inf"),
    (np.ones((2, 3)), np.ones((4, 3)), [0, 1], 0.0, "temperature: must be > 0"),
    (np.ones((2, 3)), np.ones((4, 3)), [0, 1], -1.0, "temperature: must be > 0"),
    (np.ones((2, 3)), np.ones((4, 3)), [0, 1], float("nan"), "temperature: must be finite"),
])
def test_bad_input_is_named(hidden, weight, ids, temperature, match):
    with pytest.raises(ValueError, match=match):
        otb.token_statistics_from_hidden(hidden, weight, ids, temperature=temperature)
    with pytest.raises(ValueError, match=match):
        otb.token_statistics_vjp(hidden, weight, ids, np.ones(np.shape(ids)), None, temperature=temperature)


def test_bad_types_are_named():
    with pytest.raises(TypeError, match="token_ids: expected integer"):
        otb.token_statistics_from_hidden(np.ones((2, 3)), np.ones((4, 3)), [0.0, 1.0])
    with pytest.raises(TypeError, match="temperature: expected a real number, got a bool"):
        otb.token_statistics_from_hidden(np.ones((2, 3)), np.ones((4, 3)), [0, 1], temperature=True)
    with pytest.raises(ValueError, match="log_probs_cotangent: expected shape \\(2,\\)"):
        otb.token_statistics_vjp(np.ones((2, 3)), np.ones((4, 3)), [0, 1], np.ones(3), None)


# ----------------------------------------------------------------------------------------------------------------------
# the error bounds: a correct float32 program passes, a wrong one does not


def _float32_unfused(case: otb_st.LMHeadCase, *, temperature_bug: bool = False) -> dict[str, np.ndarray]:
    """A plain float32 implementation (logits materialised, torch's log_softmax), values and gradients."""
    h = torch.tensor(case.hidden, dtype=torch.float32, requires_grad=True)
    w = torch.tensor(case.weight, dtype=torch.float32, requires_grad=True)
    logits = h @ w.T / (1.0 if temperature_bug else case.temperature)
    log_probs = torch.log_softmax(logits, -1)
    probs = log_probs.exp()
    chosen = log_probs.gather(-1, torch.tensor(case.token_ids)[..., None])[..., 0]
    entropy = torch.logsumexp(logits, -1) - (probs * logits).sum(-1)          # verl's form: it cancels
    spp = probs.square().sum(-1)
    (chosen * torch.tensor(case.log_probs_cotangent, dtype=torch.float32)
     + entropy * torch.tensor(case.entropy_cotangent, dtype=torch.float32)).sum().backward()
    return {"log_probs": chosen, "entropy": entropy, "sum_pi_squared": spp, "hidden": h.grad, "weight": w.grad}


def _float32_case(case: otb_st.LMHeadCase) -> otb_st.LMHeadCase:
    return case._replace(hidden=case.hidden.astype(np.float32).astype(np.float64),
                         weight=case.weight.astype(np.float32).astype(np.float64))


@given(case=cases.map(_float32_case))
def test_a_correct_float32_implementation_is_within_the_bounds(case):
    """The bounds hold for an unfused float32 program with verl's cancelling entropy form (any correct evaluation
    must pass: docs/tolerances.md, "Token statistics from hidden states")."""
    got = {name: value.detach().double().numpy() for name, value in _float32_unfused(case).items()}
    exact = otb.token_statistics_from_hidden(case.hidden, case.weight, case.token_ids, temperature=case.temperature)
    gradients = otb.token_statistics_vjp(case.hidden, case.weight, case.token_ids, case.log_probs_cotangent,
                                         case.entropy_cotangent, temperature=case.temperature)
    statistics, (bound_h, bound_w) = hidden_comparison_tolerances(
        case.hidden, case.weight, case.token_ids, temperature=case.temperature,
        log_probs_cotangent=case.log_probs_cotangent, entropy_cotangent=case.entropy_cotangent, input_dtype="float32")
    for name in ("log_probs", "entropy", "sum_pi_squared"):
        getattr(statistics, name).assert_close(got[name], getattr(exact, name), name)
    bound_h.assert_close(got["hidden"], gradients.hidden, "∂hidden")
    bound_w.assert_close(got["weight"], gradients.weight, "∂weight")


def test_the_bounds_reject_a_wrong_implementation():
    """Claim test: a float32 program that forgets τ is outside the bounds (so the bounds can fail)."""
    rng = np.random.default_rng(3)
    hidden, weight = rng.normal(size=(6, 8)), rng.normal(size=(40, 8))
    case = _float32_case(otb_st.LMHeadCase(hidden, weight, rng.integers(0, 40, 6), 0.5, rng.normal(size=6),
                                           rng.normal(size=6)))
    wrong = {name: value.detach().double().numpy() for name, value in
             _float32_unfused(case, temperature_bug=True).items()}
    exact = otb.token_statistics_from_hidden(case.hidden, case.weight, case.token_ids, temperature=case.temperature)
    statistics, (bound_h, _) = hidden_comparison_tolerances(case.hidden, case.weight, case.token_ids,
                                                            temperature=case.temperature, input_dtype="float32",
                                                            log_probs_cotangent=case.log_probs_cotangent,
                                                            entropy_cotangent=case.entropy_cotangent)
    for name in ("log_probs", "entropy", "sum_pi_squared"):
        assert not getattr(statistics, name).holds(wrong[name], getattr(exact, name)), name
    gradients = otb.token_statistics_vjp(case.hidden, case.weight, case.token_ids, case.log_probs_cotangent,
                                         case.entropy_cotangent, temperature=case.temperature)
    assert not bound_h.holds(wrong["hidden"], gradients.hidden)


def test_the_bounds_grow_with_the_working_precision():
    """bfloat16 per-token work is allowed more error than float32, float32 more than float64."""
    rng = np.random.default_rng(4)
    hidden, weight, ids = rng.normal(size=(4, 6)), rng.normal(size=(30, 6)), rng.integers(0, 30, 4)
    widths = [hidden_statistics_tolerance(hidden, weight, ids, dtype=dtype).log_probs.atol
              for dtype in ("float64", "float32", "bfloat16")]
    assert np.all(widths[0] < widths[1]) and np.all(widths[1] < widths[2])
    assert np.all(widths[0] < 1e-9)


def test_float32_gradients_returned_in_float64_may_underflow_to_zero():
    """A float32 program whose π underflows (logits 400 apart: π ≈ 1e-168) returns ∂W = 0 there; returned as float64,
    no output rounding covers that, so the bound must (U_v, docs/tolerances.md) — verl's FusedLinearForPPO with float64
    inputs is such a program."""
    rng = np.random.default_rng(5)
    hidden = rng.normal(size=(5, 8))
    weight = rng.normal(size=(45, 8)) * 150.0 / np.sqrt(8)
    case = _float32_case(otb_st.LMHeadCase(hidden, weight, rng.integers(0, 45, 5), 1.0, rng.normal(size=5),
                                           rng.normal(size=5)))
    got = {name: value.detach().double().numpy() for name, value in _float32_unfused(case).items()}
    gradients = otb.token_statistics_vjp(case.hidden, case.weight, case.token_ids, case.log_probs_cotangent,
                                         case.entropy_cotangent, temperature=case.temperature)
    underflowed = (got["weight"] == 0) & (gradients.weight != 0)
    assert underflowed.any()                            # the case does what it says
    _, (bound_h, bound_w) = hidden_comparison_tolerances(
        case.hidden, case.weight, case.token_ids, log_probs_cotangent=case.log_probs_cotangent,
        entropy_cotangent=case.entropy_cotangent, input_dtype="float32", output_dtype="float64")
    bound_h.assert_close(got["hidden"], gradients.hidden, "∂hidden")
    bound_w.assert_close(got["weight"], gradients.weight, "∂weight")


def test_gradients_on_a_machine_that_flushes_subnormals_are_within_the_bounds():
    """A float64 program whose matmul flushes products below float64's smallest normal to zero (XLA's CPU backend
    does): with an LM head of 4e-307 the exact ∂h is 0 (Σ_v ∂z_v = 0 and W's rows are equal) but the surviving
    products leave ~1e-307 — within the bound's (2V + 2)·η_a term, outside it without (Hypothesis found this on
    otb_jax's float64 port)."""
    rng = np.random.default_rng(6)
    hidden = np.zeros((4, 3))
    hidden[:, 0] = rng.normal(size=4) * 1e-3
    weight = np.full((23, 3), 4.26245325e-307)
    weight[:, 0] = rng.normal(size=23) * 100.0
    ids, g_lp, g_h = rng.integers(0, 23, 4), rng.normal(size=4), rng.normal(size=4)
    logits = lm_head_logits(hidden, weight)
    d_logits = logit_cotangent(logits, ids, g_lp, g_h)
    products = d_logits[:, :, None] * weight[None, :, :]
    flushed = np.where(np.abs(products) < np.finfo(np.float64).tiny, 0.0, products).sum(axis=1)
    exact = otb.token_statistics_vjp(hidden, weight, ids, g_lp, g_h).hidden
    assert np.any(flushed[:, 1:] != exact[:, 1:])                          # the flush changed the tiny columns
    _, (bound_h, _) = hidden_comparison_tolerances(hidden, weight, ids, log_probs_cotangent=g_lp,
                                                   entropy_cotangent=g_h, input_dtype="float64")
    bound_h.assert_close(flushed, exact, "∂hidden with flushed products")
