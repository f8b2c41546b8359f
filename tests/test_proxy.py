"""The Logit-Gradient Proxy: Σπ², the per-token weight, and the gradient identity behind them."""

from __future__ import annotations

import mpmath
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import otb_spec as otb
from otb_spec import strategies as otb_st
from otb_spec.tolerances import elementwise_tolerance, logsumexp_tolerance, proxy_tolerance, summation_tolerance

logit_rows = otb_st.logits((3,), min_vocab_size=1, max_vocab_size=40, allow_neg_inf=False)
extreme_rows = otb_st.logits((2,), min_vocab_size=2, max_vocab_size=40, extreme=True)
masked_rows = otb_st.logits((3,), min_vocab_size=2, max_vocab_size=40, allow_neg_inf=True)


def _spread(logits: np.ndarray) -> float:
    finite = logits[np.isfinite(logits)]
    return float(finite.max() - finite.min()) if finite.size else 0.0


def _complex_step_log_softmax_jacobian(logits: np.ndarray, step: float = 1e-30) -> np.ndarray:
    """∂ log softmax(z)_y / ∂z_v by the complex-step method: Im f(z + i·h·e_v) / h, free of cancellation.

    Independent of the analytic formula δ_yv − π_v: it only evaluates log softmax in complex arithmetic.
    """
    vocab = logits.shape[-1]
    jacobian = np.empty(logits.shape[:-1] + (vocab, vocab))
    for v in range(vocab):
        perturbed = logits.astype(np.complex128)
        perturbed[..., v] += 1j * step
        shift = np.max(logits, axis=-1, keepdims=True)
        lse = shift + np.log(np.sum(np.exp(perturbed - shift), axis=-1, keepdims=True))
        jacobian[..., :, v] = np.imag(perturbed - lse) / step
    return jacobian


# ----------------------------------------------------------------------------------------------------------------------
# T1: w = 1 − 2π_y + Σπ² = ‖∇_z log softmax(z)_y‖²


@pytest.mark.bitexact
@given(logits=logit_rows, data=st.data())
def test_proxy_equals_squared_norm_of_the_logit_gradient(logits, data):
    """T1 (proofs/T1_proxy_identity.md): the proxy from (log π(y), Σπ²) equals ‖J[y]‖², J the analytic Jacobian."""
    vocab = logits.shape[-1]
    token_ids = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=3, max_size=3), label="token_ids"))
    jacobian = otb.log_softmax_jacobian(logits)
    rows = np.take_along_axis(jacobian, token_ids[:, None, None], axis=1)[:, 0, :]
    squared_norm = np.sum(np.square(rows), axis=-1)
    proxy = otb.token_energy(otb.token_log_probs(logits, token_ids), otb.sum_pi_squared(logits))
    direct = otb.token_energy_from_logits(logits, token_ids)
    tolerance = summation_tolerance(vocab + 4, 4.0) + proxy_tolerance(vocab, float(np.abs(logits).max()))
    tolerance.assert_close(proxy, squared_norm, "proxy vs ‖J[y]‖²")
    tolerance.assert_close(direct, squared_norm, "proxy from logits vs ‖J[y]‖²")
    np.testing.assert_allclose(rows, otb.logit_gradient(logits, token_ids), rtol=0, atol=0)


@given(logits=logit_rows)
def test_analytic_jacobian_matches_the_complex_step_derivative(logits):
    """J = I − 1πᵀ (∂ log π_y/∂z_v = δ_yv − π_v) agrees with a derivative computed without the formula."""
    vocab = logits.shape[-1]
    numeric = _complex_step_log_softmax_jacobian(logits)
    summation_tolerance(vocab, 2.0).assert_close(otb.log_softmax_jacobian(logits), numeric, "Jacobian")


@given(logits=logit_rows, data=st.data())
def test_proxy_lies_in_zero_to_two(logits, data):
    """0 ≤ w < 2: w = (1 − π_y)² + Σ_{v≠y} π_v² with Σ_{v≠y} π_v = 1 − π_y."""
    vocab = logits.shape[-1]
    token_ids = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=3, max_size=3), label="token_ids"))
    w = otb.token_energy_from_logits(logits, token_ids)
    assert np.all(w >= 0.0)
    assert np.all(w <= 2.0)
    probs = np.exp(otb.log_softmax(logits))
    np.put_along_axis(probs, token_ids[:, None], 0.0, axis=-1)
    well_separated = probs.max(axis=-1) < 1 - 1e-6   # w = 2 − O(1 − max other π): strictly below 2 in float64
    assert np.all(w[well_separated] < 2.0)


# ----------------------------------------------------------------------------------------------------------------------
# Σπ²


@given(logits=extreme_rows)
def test_sum_pi_squared_matches_mpmath_at_extreme_logits(logits):
    """Σπ² against a 60-digit evaluation of exp(lse(2z) − 2·lse(z)) for logits spanning up to ±1e4."""
    mpmath.mp.dps = 60
    expected = []
    for row in logits:
        values = [mpmath.mpf(float(z)) for z in row]
        lse = mpmath.log(mpmath.fsum(mpmath.exp(z) for z in values))
        lse2 = mpmath.log(mpmath.fsum(mpmath.exp(2 * z) for z in values))
        expected.append(float(mpmath.exp(lse2 - 2 * lse)))
    logsumexp_tolerance(logits.shape[-1], _spread(logits)).assert_close(otb.sum_pi_squared(logits),
                                                                        np.array(expected), "Σπ²")


@given(logits=extreme_rows)
def test_logsumexp_matches_mpmath_at_extreme_logits(logits):
    mpmath.mp.dps = 60
    expected = [float(mpmath.log(mpmath.fsum(mpmath.exp(mpmath.mpf(float(z))) for z in row))) for row in logits]
    lse, _ = otb.logsumexp_and_sum_pi_squared(logits)
    summation_tolerance(logits.shape[-1], float(np.abs(logits).max()) + 1.0).assert_close(lse, expected, "lse")


@given(logits=st.one_of(logit_rows, extreme_rows, masked_rows))
def test_sum_pi_squared_lies_between_one_over_v_and_one(logits):
    """1/V' ≤ Σπ² ≤ 1 with V' the number of tokens of non-zero probability (Cauchy–Schwarz, and π_v ≤ 1)."""
    spp = otb.sum_pi_squared(logits)
    effective_vocab = np.isfinite(logits).sum(axis=-1)
    tolerance = logsumexp_tolerance(logits.shape[-1], _spread(logits))
    assert np.all(spp <= 1.0 + tolerance.rtol)
    assert np.all(spp >= (1.0 / effective_vocab) * (1 - tolerance.rtol))


@given(logits=masked_rows)
def test_negative_infinite_logits_mean_probability_zero(logits):
    """An entry of −inf contributes exactly nothing: the result equals that of the logits without it."""
    spp = otb.sum_pi_squared(logits)
    for row, value in zip(logits, spp):
        kept = row[np.isfinite(row)]
        logsumexp_tolerance(row.shape[-1], _spread(row)).assert_close(value, otb.sum_pi_squared(kept), "Σπ²")


@pytest.mark.bitexact
@given(logits=st.one_of(logit_rows, extreme_rows), chunk=st.integers(1, 4))
def test_chunking_does_not_change_the_result(logits, chunk):
    """Rows are independent: any chunk size gives the same bits."""
    np.testing.assert_array_equal(otb.sum_pi_squared(logits, chunk_size=chunk), otb.sum_pi_squared(logits))


@pytest.mark.bitexact
def test_default_chunking_of_a_large_batch_matches_row_by_row():
    rng = np.random.default_rng(0)
    logits = rng.normal(scale=5.0, size=(3, 700, 64))     # 134 400 logits … split into chunks internally
    spp = otb.sum_pi_squared(logits, chunk_size=97)
    np.testing.assert_array_equal(spp, otb.sum_pi_squared(logits))
    np.testing.assert_array_equal(spp[1, 5], otb.sum_pi_squared(logits[1, 5]))


@pytest.mark.bitexact
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16", "float32"])
def test_low_precision_logits_are_accumulated_in_float64(dtype_name):
    """Half-precision logits (|z| up to the format's range) are read exactly and reduced in float64."""
    if dtype_name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        dtype = ml_dtypes.bfloat16
    else:
        dtype = np.dtype(dtype_name)
    rng = np.random.default_rng(1)
    logits = (rng.normal(scale=20.0, size=(8, 300)) + 6e4 * (dtype_name == "float16")).astype(dtype)
    exact = otb.sum_pi_squared(np.asarray(logits, dtype=np.float64))
    np.testing.assert_array_equal(otb.sum_pi_squared(logits), exact)
    assert otb.sum_pi_squared(logits).dtype == np.float64


# ----------------------------------------------------------------------------------------------------------------------
# vocabulary shards


@given(logits=st.one_of(logit_rows, extreme_rows, masked_rows), data=st.data())
def test_combining_vocab_shards_equals_the_unsharded_result(logits, data):
    """Partials (max, Σexp, Σexp²) of any split of the vocabulary, combined in any order, give the unsharded
    log-sum-exp and Σπ² (the reference for vocab-parallel implementations)."""
    vocab = logits.shape[-1]
    cuts = sorted(data.draw(st.sets(st.integers(1, max(vocab - 1, 1)), max_size=min(vocab - 1, 4)), label="cuts"))
    shards = [logits[..., start:stop] for start, stop in zip([0, *cuts], [*cuts, vocab])]
    # a shard may be all −inf at some positions (its partials are then the identity there)
    order = data.draw(st.permutations(range(len(shards))), label="shard order")
    partials = [otb.vocab_shard_partials(shards[k]) for k in order]
    combined = otb.combine_vocab_shards(partials)
    whole = otb.vocab_shard_partials(logits)
    tolerance = logsumexp_tolerance(vocab, _spread(logits))
    tolerance.assert_close(combined.sum_pi_squared, otb.sum_pi_squared(logits), "Σπ² from shards")
    summation_tolerance(vocab, float(np.abs(logits[np.isfinite(logits)]).max()) + 1.0).assert_close(
        combined.logsumexp, whole.logsumexp, "lse from shards")


@pytest.mark.bitexact
@given(logits=otb_st.logits((2,), min_vocab_size=3, max_vocab_size=30))
def test_combining_shards_is_associative(logits):
    a, b, c = (otb.vocab_shard_partials(part) for part in np.array_split(logits, 3, axis=-1))
    left = otb.combine_vocab_shards([otb.combine_vocab_shards([a, b]), c])
    right = otb.combine_vocab_shards([a, otb.combine_vocab_shards([b, c])])
    tolerance = logsumexp_tolerance(logits.shape[-1], _spread(logits))
    tolerance.assert_close(left.sum_pi_squared, right.sum_pi_squared, "Σπ² ((a·b)·c vs a·(b·c))")
    np.testing.assert_array_equal(left.max_logit, right.max_logit)


@pytest.mark.bitexact
def test_an_all_excluded_shard_contributes_the_identity():
    identity = otb.vocab_shard_partials([[-np.inf, -np.inf], [0.0, -np.inf]])
    assert identity.max_logit[0] == -np.inf and identity.sum_exp[0] == 0 and identity.sum_exp_squared[0] == 0
    other = otb.vocab_shard_partials([[1.0, 2.0], [0.5, 0.0]])
    combined = otb.combine_vocab_shards([identity, other])
    np.testing.assert_array_equal(combined.sum_pi_squared[0], other.sum_pi_squared[0])
    with pytest.raises(ValueError, match="every logit is -inf at position"):
        _ = identity.sum_pi_squared


def test_shard_partials_of_a_worked_example():
    """z = (0, log 3 | log 2, 0): shard maxima log 3 and log 2; S₁ = 4/3 and 3/2; combined lse = log 7."""
    first = otb.vocab_shard_partials([0.0, np.log(3.0)])
    second = otb.vocab_shard_partials([np.log(2.0), 0.0])
    elementwise_tolerance().assert_close(first.sum_exp, 4 / 3)
    combined = otb.combine_vocab_shards([first, second])
    elementwise_tolerance().assert_close(combined.logsumexp, np.log(7.0))
    # π = (1, 3, 2, 1)/7 → Σπ² = (1 + 9 + 4 + 1)/49
    elementwise_tolerance().assert_close(combined.sum_pi_squared, 15 / 49)


# ----------------------------------------------------------------------------------------------------------------------
# log-probabilities


@given(logits=st.one_of(logit_rows, masked_rows), data=st.data())
def test_token_log_probs_are_the_log_softmax_entries(logits, data):
    vocab = logits.shape[-1]
    finite_ids = [int(data.draw(st.sampled_from(np.flatnonzero(np.isfinite(row)).tolist()), label="token"))
                  for row in logits]
    ids = np.array(finite_ids)
    expected = np.take_along_axis(otb.log_softmax(logits), ids[:, None], axis=-1)[:, 0]
    elementwise_tolerance().assert_close(otb.token_log_probs(logits, ids), expected, "log π(y)")
    assert np.all(otb.token_log_probs(logits, ids) <= 0.0) or vocab == 1


# ----------------------------------------------------------------------------------------------------------------------
# entropy and the fused statistics


@given(logits=st.one_of(logit_rows, extreme_rows, masked_rows))
def test_entropy_matches_mpmath(logits):
    """H = −Σ π log π against a 60-digit evaluation (−inf logits contribute 0)."""
    mpmath.mp.dps = 60
    expected = []
    for row in logits:
        finite = [mpmath.mpf(float(z)) for z in row if np.isfinite(z)]
        lse = mpmath.log(mpmath.fsum(mpmath.exp(z) for z in finite))
        expected.append(float(-mpmath.fsum(mpmath.exp(z - lse) * (z - lse) for z in finite)))
    vocab = logits.shape[-1]
    magnitude = float(np.abs(logits[np.isfinite(logits)]).max()) + np.log(vocab) + 1.0
    summation_tolerance(4 * vocab, magnitude).assert_close(otb.token_entropy(logits), expected, "entropy")


@pytest.mark.bitexact
@given(logits=st.one_of(logit_rows, extreme_rows), data=st.data(), chunk=st.sampled_from([None, 1, 2]))
def test_fused_statistics_equal_the_separate_functions(logits, data, chunk):
    vocab = logits.shape[-1]
    ids = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=logits.shape[0],
                                      max_size=logits.shape[0]), label="token_ids"))
    fused = otb.token_statistics_from_logits(logits, ids, chunk_size=chunk)
    tolerance = logsumexp_tolerance(vocab, _spread(logits))
    tolerance.assert_close(fused.sum_pi_squared, otb.sum_pi_squared(logits), "Σπ²")
    summation_tolerance(vocab, float(np.abs(logits).max()) + 1.0).assert_close(
        fused.log_probs, otb.token_log_probs(logits, ids), "log π(y)")
    np.testing.assert_array_equal(fused.entropy, otb.token_entropy(logits, chunk_size=chunk))
    assert otb.token_statistics_from_logits(logits, None).log_probs is None
