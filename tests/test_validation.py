"""Every bad input gets a ValueError/TypeError that names the argument and the problem (never a silent NaN)."""

from __future__ import annotations

import numpy as np
import pytest

import otb_spec as otb
from otb_spec import tolerances

B, T = 3, 4
GOOD = dict(
    rewards=np.zeros((B, T)),
    response_mask=np.ones((B, T)),
    group_ids=np.array([0, 0, 1]),
    log_probs=np.full((B, T), -0.5),
    sum_pi_squared=np.full((B, T), 0.5),
)
OTB_FUNCTIONS = [otb.optimal_token_baseline, otb.multi_turn_optimal_token_baseline, otb.leave_one_out_token_baseline]


def _call(function, **changes):
    arguments = {**GOOD, **changes}
    keyword = {name: arguments.pop(name) for name in list(arguments) if name not in GOOD}
    return function(arguments["rewards"], arguments["response_mask"], arguments["group_ids"], arguments["log_probs"],
                    arguments["sum_pi_squared"], **keyword)


def _with(array, index, value):
    copy = np.array(array, dtype=np.float64)
    copy[index] = value
    return copy


CASES = [
    ("empty batch", dict(rewards=np.zeros((0, T))), ValueError, r"rewards: empty batch \(B = 0"),
    ("no positions", dict(rewards=np.zeros((B, 0))), ValueError, r"rewards: no positions \(T = 0\)"),
    ("rewards 1-D", dict(rewards=np.zeros(B)), ValueError, r"rewards: expected shape \[B, T\]"),
    ("mask shape", dict(response_mask=np.ones((B, T + 1))), ValueError,
     r"response_mask: expected shape \(3, 4\) \(the shape of rewards\), got \(3, 5\)"),
    ("log_probs rows", dict(log_probs=np.zeros((B + 1, T))), ValueError, r"log_probs: expected shape \(3, 4\)"),
    ("spp columns", dict(sum_pi_squared=np.zeros((B, T - 1))), ValueError, r"sum_pi_squared: expected shape"),
    ("NaN reward", dict(rewards=_with(GOOD["rewards"], (1, 2), np.nan)), ValueError,
     r"rewards: contains NaN or ±inf \(first at index \(1, 2\)"),
    ("inf reward at masked position", dict(rewards=_with(GOOD["rewards"], (0, 3), np.inf),
                                           response_mask=_with(GOOD["response_mask"], (0, 3), 0)),
     ValueError, r"rewards: contains NaN or ±inf \(first at index \(0, 3\)"),
    ("NaN log prob", dict(log_probs=_with(GOOD["log_probs"], (2, 0), np.nan)), ValueError, r"log_probs: contains NaN"),
    ("-inf log prob", dict(log_probs=_with(GOOD["log_probs"], (2, 0), -np.inf)), ValueError, r"log_probs: contains"),
    ("inf spp", dict(sum_pi_squared=_with(GOOD["sum_pi_squared"], (0, 0), np.inf)), ValueError,
     r"sum_pi_squared: contains"),
    ("mask value 2", dict(response_mask=_with(GOOD["response_mask"], (1, 1), 2)), ValueError,
     r"response_mask: values must be exactly 0 or 1, found 2.0 at index \(1, 1\)"),
    ("mask value 0.5", dict(response_mask=_with(GOOD["response_mask"], (0, 0), 0.5)), ValueError,
     r"response_mask: values must be exactly 0 or 1"),
    ("mask NaN", dict(response_mask=_with(GOOD["response_mask"], (0, 0), np.nan)), ValueError,
     r"response_mask: values must be exactly 0 or 1"),
    ("probabilities passed as log-probabilities", dict(log_probs=np.full((B, T), 0.6)), ValueError,
     r"log_probs: must be ≤ 0 at valid positions"),
    ("Σπ² above one", dict(sum_pi_squared=np.full((B, T), 1.5)), ValueError,
     r"sum_pi_squared: must lie in \[0, 1\] at valid positions"),
    ("Σπ² negative", dict(sum_pi_squared=np.full((B, T), -0.2)), ValueError, r"sum_pi_squared: must lie in \[0, 1\]"),
    ("Σπ² below π²", dict(log_probs=np.full((B, T), np.log(0.9)), sum_pi_squared=np.full((B, T), 0.5)), ValueError,
     r"sum_pi_squared: must be ≥ π² = exp\(2·log_probs\)"),
    ("negative IS weight", dict(is_weights=_with(np.ones((B, T)), (2, 3), -0.1)), ValueError,
     r"is_weights: must be ≥ 0, found -0.1 at index \(2, 3\)"),
    ("IS weight shape", dict(is_weights=np.ones((B, 1))), ValueError, r"is_weights: expected shape \(3, 4\)"),
    ("IS weight NaN", dict(is_weights=_with(np.ones((B, T)), (0, 0), np.nan)), ValueError, r"is_weights: contains"),
    ("negative epsilon", dict(epsilon=-1e-8), ValueError, r"epsilon: must be ≥ 0"),
    ("NaN epsilon", dict(epsilon=float("nan")), ValueError, r"epsilon: must be finite"),
    ("text epsilon", dict(epsilon="1e-8"), TypeError, r"epsilon: expected a real number, got text '1e-8'"),
    ("bytes epsilon", dict(epsilon=b"1"), TypeError, r"epsilon: expected a real number, got text b'1'"),
    ("array-of-text epsilon", dict(epsilon=np.array("1e-8")), TypeError, r"epsilon: expected a real number, got text"),
    ("string rewards", dict(rewards=np.array([["a"] * T] * B)), TypeError, r"rewards: expected real numbers"),
    ("complex rewards", dict(rewards=np.zeros((B, T), dtype=complex)), TypeError, r"rewards: expected real numbers"),
    ("None log_probs", dict(log_probs=None), TypeError, r"log_probs: expected an array, got None"),
    ("ragged rewards", dict(rewards=[[0.0, 1.0], [0.0]]), (TypeError, ValueError), r"rewards: "),
    # finite, but Σᵢ GₜⁱWₜⁱ (or the returns-to-go) beyond float64: an error, not ±inf/NaN and RuntimeWarnings
    ("rewards whose weighted sums overflow", dict(rewards=_with(GOOD["rewards"], (slice(None), -1), 1.5e308)),
     ValueError, r"rewards: finite, but the baseline's float64 arithmetic overflows"),
    ("rewards whose returns-to-go overflow", dict(rewards=_with(GOOD["rewards"], (1, slice(2, None)), 1.5e308)),
     ValueError, r"rewards: finite, but the baseline's float64 arithmetic overflows: returns up to inf"),
    # ρ² beyond float64 makes the realized energy overflow: the weights are named, not the rewards
    ("importance weights whose squares overflow", dict(is_weights=_with(np.ones((B, T)), (0, 1), 1e160)),
     ValueError, r"is_weights: finite, but ρ² in the realized energy Σ ρ²·\(1 − 2π \+ Σπ²\) overflows float64 "
                 r"\(ρ up to 1e\+160\)"),
]


@pytest.mark.parametrize("function", OTB_FUNCTIONS, ids=lambda f: f.__name__)
@pytest.mark.parametrize("case, changes, error, message", CASES, ids=[case[0] for case in CASES])
def test_bad_input_is_rejected_with_a_named_error(function, case, changes, error, message):
    with pytest.raises(error, match=message):
        _call(function, **changes)


@pytest.mark.parametrize("function", OTB_FUNCTIONS[:2], ids=lambda f: f.__name__)
def test_handle_zero_tail_must_be_a_bool(function):
    with pytest.raises(TypeError, match="handle_zero_tail: expected True or False"):
        _call(function, handle_zero_tail="yes")


def test_values_out_of_range_at_masked_positions_are_allowed():
    """Padding often carries log π = 0 and Σπ² = 0 (w = −1): masked positions are ignored, as in verl."""
    mask = np.ones((B, T))
    mask[:, -1] = 0
    result = _call(otb.optimal_token_baseline, response_mask=mask, log_probs=_with(GOOD["log_probs"], (0, 3), 5.0),
                   sum_pi_squared=_with(GOOD["sum_pi_squared"], (0, 3), -3.0))
    assert np.isfinite(result.advantages).all()


def test_rounding_slack_of_the_input_precision_is_accepted():
    """float32 producers may overshoot Σπ² ≤ 1 or log π ≤ 0 by rounding: within the float32 slack it is accepted."""
    result = _call(otb.optimal_token_baseline, log_probs=np.full((B, T), 1e-6, dtype=np.float32),
                   sum_pi_squared=np.full((B, T), 1.0 + 1e-6, dtype=np.float32))
    assert np.isfinite(result.advantages).all()
    with pytest.raises(ValueError, match="log_probs: must be ≤ 0"):
        _call(otb.optimal_token_baseline, log_probs=np.full((B, T), 1e-6), sum_pi_squared=np.full((B, T), 1.0))


def test_leave_one_out_rejects_a_zero_tail_request():
    with pytest.raises(ValueError, match=r"handle_zero_tail: not applicable to the leave-one-out baseline "
                                         r"\(leave_one_out=True, variant='leave_one_out'\)"):
        otb.token_baseline(np.zeros((B, T)), np.ones((B, T)), np.ones((B, T)), [0, 0, 1], leave_one_out=True,
                           handle_zero_tail=True)
    with pytest.raises(ValueError, match="align: expected one of"):
        otb.token_baseline(np.zeros((B, T)), np.ones((B, T)), np.ones((B, T)), [0, 0, 1], align="turn")


def test_token_statistics_without_a_mask_say_every_position():
    """token_energy has no mask: its errors say the rule holds at every position, not "at valid positions"."""
    from otb_spec.proxy import token_energy

    with pytest.raises(ValueError, match=r"^log_probs: must be ≤ 0 at every position \(no mask here\)"):
        token_energy(np.full((2, 3), 0.5), np.full((2, 3), 0.5))
    with pytest.raises(ValueError, match=r"^sum_pi_squared: must be ≥ π² = exp\(2·log_probs\) at every position"):
        token_energy(np.zeros((2, 3)), np.zeros((2, 3)))


def test_energy_and_norm_arguments_must_be_nonnegative():
    with pytest.raises(ValueError, match=r"realized_energy: must be ≥ 0 at valid positions"):
        otb.token_baseline(np.zeros((B, T)), -np.ones((B, T)), np.ones((B, T)), [0, 0, 1])
    with pytest.raises(ValueError, match=r"cumulative_score_sq_norms: must be ≥ 0 at valid positions"):
        otb.exact_norm_token_baseline(np.zeros((B, T)), np.ones((B, T)), [0, 0, 1], -np.ones((B, T)))
    with pytest.raises(ValueError, match=r"token_energy: must be ≥ 0 at valid positions"):
        otb.realized_energy(-np.ones((B, T)), np.ones((B, T)))
    with pytest.raises(ValueError, match=r"sequence_score_sq_norms: must be ≥ 0"):
        otb.sequence_optimal_advantage(np.zeros((B, T)), np.ones((B, T)), [0, 0, 1], [-1.0, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"sequence_score_sq_norms: expected shape \(3,\)"):
        otb.sequence_optimal_advantage(np.zeros((B, T)), np.ones((B, T)), [0, 0, 1], [1.0, 0.0])


def test_finite_arguments_whose_weighted_sums_overflow_are_named():
    """The general functions name their own argument where Σᵢ GₜⁱWₜⁱ leaves float64 (each product alone fits)."""
    with pytest.raises(ValueError, match=r"^returns: finite, but the baseline's float64 arithmetic overflows"):
        otb.token_baseline(np.full((B, T), 1e308), np.full((B, T), 1.5), np.ones((B, T)), [0, 0, 1])
    with pytest.raises(ValueError, match=r"^rewards: finite, but the baseline's float64 arithmetic overflows"):
        otb.exact_norm_token_baseline(_with(np.zeros((B, T)), (slice(None), -1), 1e308), np.ones((B, T)), [0, 0, 1],
                                      np.full((B, T), 1.5))


def test_gamma_must_be_a_discount():
    for gamma, message in [(0.0, "gamma: must be > 0"), (1.5, "gamma: must be ≤ 1"), (True, "gamma: expected a real")]:
        with pytest.raises((ValueError, TypeError), match=message):
            otb.returns_to_go(np.zeros((B, T)), np.ones((B, T)), gamma=gamma)


@pytest.mark.parametrize("logits, message, error", [
    (np.array([[0.0, np.nan]]), "logits: contains NaN or \\+inf", ValueError),
    (np.array([[0.0, np.inf]]), "logits: contains NaN or \\+inf", ValueError),
    (np.array([[-np.inf, -np.inf]]), "logits: every logit is -inf at position \\(0,\\)", ValueError),
    (np.zeros((2, 0)), "logits: the vocabulary axis is empty", ValueError),
    (np.float64(1.0), "logits: expected shape \\[..., V\\]", ValueError),
    (np.array([["x", "y"]]), "logits: expected real numbers", TypeError),
])
def test_bad_logits_are_rejected(logits, message, error):
    with pytest.raises(error, match=message):
        otb.sum_pi_squared(logits)


def test_bad_token_ids_and_chunk_sizes_are_rejected():
    logits = np.zeros((2, 3))
    with pytest.raises(ValueError, match=r"token_ids: must lie in \[0, 3\)"):
        otb.token_log_probs(logits, [0, 3])
    with pytest.raises(TypeError, match="token_ids: expected integer token ids"):
        otb.token_energy_from_logits(logits, [0.0, 1.0])
    with pytest.raises(ValueError, match=r"token_ids: expected shape \(2,\)"):
        otb.logit_gradient(logits, [0, 1, 2])
    with pytest.raises(ValueError, match="chunk_size: expected a positive integer"):
        otb.sum_pi_squared(logits, chunk_size=0)
    with pytest.raises(ValueError, match="partials: need at least one shard"):
        otb.combine_vocab_shards([])
    bad = otb.ShardPartials(np.zeros(2), np.full(2, 0.5), np.ones(2))
    with pytest.raises(ValueError, match=r"partials\[0\]: sum_exp must be ≥ 1"):
        otb.combine_vocab_shards([bad])
    with pytest.raises(ValueError, match=r"partials\[1\]: leading shape differs"):
        otb.combine_vocab_shards([otb.vocab_shard_partials(logits), otb.vocab_shard_partials(np.zeros((3, 3)))])


def test_cuda_like_objects_get_a_clear_conversion_error():
    class DeviceTensor:
        def __array__(self, dtype=None, copy=None):
            raise TypeError("can't convert cuda:0 device type tensor to numpy")
    with pytest.raises(TypeError, match="rewards: cannot be converted to a NumPy array"):
        _call(otb.optimal_token_baseline, rewards=DeviceTensor())


def test_float32_statistics_cast_to_float64_get_a_hint_about_the_cast():
    """π² ≤ Σπ² holds for this float32 pair within float32's slack, not within float64's: given as float32 it is
    accepted; cast to float64 first it is rejected, and the message names the cast as a possible cause."""
    log_probs, spp = np.float32(-0.20030527), np.float32(0.6699109)
    rewards, mask = np.zeros((1, 1)), np.ones((1, 1))
    otb.optimal_token_baseline(rewards, mask, [0], np.full((1, 1), log_probs), np.full((1, 1), spp))
    with pytest.raises(ValueError, match="float32 statistics cast to float64"):
        otb.optimal_token_baseline(rewards, mask, [0], np.full((1, 1), log_probs, np.float64),
                                   np.full((1, 1), spp, np.float64))


@pytest.mark.parametrize("function", [tolerances.otb_tolerance, tolerances.otb_comparison_tolerance],
                         ids=lambda f: f.__name__)
@pytest.mark.parametrize("changes, error, message", [
    (dict(align="multi_turn"), ValueError, "align: expected one of"),
    (dict(epsilon=-1e-8), ValueError, "epsilon: must be ≥ 0"),
    (dict(epsilon=float("nan")), ValueError, "epsilon: must be finite"),
    (dict(leave_one_out="yes"), TypeError, "leave_one_out: expected True or False"),
    (dict(handle_zero_tail=1), TypeError, "handle_zero_tail: expected True or False"),
    (dict(input_dtype="complex"), ValueError, "input_dtype: expected a floating, integer or boolean dtype"),
], ids=["align", "negative-epsilon", "nan-epsilon", "leave-one-out", "zero-tail", "input-dtype"])
def test_tolerance_options_are_checked_like_the_baselines_own(function, changes, error, message):
    """The bounds are of a call that the reference would accept: an option it rejects is rejected here too (a
    bound for align="multi_turn" or ε < 0 would bound nothing)."""
    with pytest.raises(error, match=message):
        _call(function, **changes)


def test_the_precision_of_sums_must_be_a_floating_dtype():
    with pytest.raises(ValueError, match="dtype: expected a floating dtype"):
        _call(tolerances.otb_tolerance, dtype=np.int8)
    with pytest.raises(ValueError, match="compute_dtype: expected a floating dtype"):
        _call(tolerances.otb_comparison_tolerance, compute_dtype="int32")
    with pytest.raises(ValueError, match="output_dtype: expected a floating dtype"):
        _call(tolerances.otb_comparison_tolerance, output_dtype=bool)


def test_a_tolerance_compares_arrays_of_one_shape_only():
    """Broadcasting would compare the wrong elements (a [T] row against every row of [B, T]): an error instead."""
    tolerance = tolerances.Tolerance(rtol=1e-6, atol=np.full((B, T), 1e-6))
    with pytest.raises(ValueError, match=r"actual: shape \(4,\) differs from expected's \(3, 4\)"):
        tolerance.violations(np.zeros(T), np.zeros((B, T)))
    with pytest.raises(ValueError, match=r"actual: shape \(1, 4\) differs"):
        tolerance.assert_close(np.zeros((1, T)), np.zeros((B, T)))
    with pytest.raises(ValueError, match=r"atol: shape \(3, 4\) does not broadcast to the compared shape \(4,\)"):
        tolerance.holds(np.zeros(T), np.zeros(T))


def test_unchecked_elements_still_reject_infinities_and_nan():
    """An ill-conditioned element (tolerance +inf) has a finite exact value whose digits are unknown: any finite
    result passes there, but ±inf and NaN are wrong whatever the conditioning."""
    tolerance = tolerances.Tolerance(rtol=0.0, atol=np.array([np.inf, np.inf, np.inf, 0.0]))
    expected = np.array([1.0, 1.0, 1.0, np.inf])
    assert tolerance.violations([1e300, np.inf, np.nan, np.inf], expected).tolist() == [False, True, True, False]
    assert tolerance.violations([-5.0, -np.inf, 1.0, 3.0], expected).tolist() == [False, True, False, True]
    with pytest.raises(AssertionError, match="1 of 4 elements outside"):       # a report, not inf − inf warnings
        tolerance.assert_close([1e300, np.inf, 1.0, np.inf], expected)
    relative = tolerances.Tolerance(rtol=1e-6, atol=0.0)                       # rtol·inf = inf: still no pass
    assert relative.violations([5.0, np.inf, -np.inf], [np.inf, np.inf, np.inf]).tolist() == [True, False, True]


def test_tolerances_read_an_unset_zero_tail_as_the_baselines_do():
    """handle_zero_tail=None is verl's default, on for the self-inclusive baseline, off for leave-one-out."""
    for leave_one_out in (False, True):
        unset = _call(tolerances.otb_tolerance, handle_zero_tail=None, leave_one_out=leave_one_out)
        explicit = _call(tolerances.otb_tolerance, handle_zero_tail=not leave_one_out, leave_one_out=leave_one_out)
        np.testing.assert_array_equal(unset[0].atol, explicit[0].atol)
