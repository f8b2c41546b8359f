"""otb_jax specifics: jit without recompilation, vmap, use inside a caller's jit, float64, the online Σπ², errors, and
(with a GPU) the GPU backend."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
otb_jax = pytest.importorskip("otb_jax")
jnp = jax.numpy

import otb_spec as otb  # noqa: E402
from otb_jax._core import otb_pipeline_jit  # noqa: E402
from otb_spec.examples import example_batch  # noqa: E402
from accelerators import requires_jax_gpu  # noqa: E402


def _inputs(seed: int = 0):
    batch = example_batch(seed)
    ids, count = otb_jax.segment_ids(batch.group_ids)
    arrays = {name: jnp.asarray(np.asarray(getattr(batch, name), dtype=np.float32))
              for name in ("rewards", "response_mask", "log_probs", "sum_pi_squared")}
    return batch, arrays, jnp.asarray(ids), count


def test_segment_ids_number_groups_in_order_of_first_appearance():
    ids, count = otb_jax.segment_ids(np.array(["b", "a", "b", None], dtype=object))
    assert count == 3 and ids.tolist() == [0, 1, 0, 2] and ids.dtype == np.int32


def test_no_recompilation_for_batches_of_the_same_shape():
    _, arrays, ids, count = _inputs(0)
    otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, count, arrays["log_probs"],
                                   arrays["sum_pi_squared"])
    before = otb_pipeline_jit._cache_size()
    for seed in (1, 2, 3):
        _, other, _, _ = _inputs(seed)
        otb_jax.optimal_token_baseline(other["rewards"], other["response_mask"], ids, count, other["log_probs"],
                                       other["sum_pi_squared"], epsilon=1e-8 * seed)
    assert otb_pipeline_jit._cache_size() == before


def test_matches_the_reference_and_the_verl_semantics():
    batch, arrays, ids, count = _inputs()
    result = otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, count,
                                            arrays["log_probs"], arrays["sum_pi_squared"])
    expected = otb.optimal_token_baseline(np.asarray(arrays["rewards"]), batch.response_mask, batch.group_ids,
                                          np.asarray(arrays["log_probs"]), np.asarray(arrays["sum_pi_squared"]))
    np.testing.assert_allclose(np.asarray(result.advantages), expected.advantages, rtol=1e-5, atol=1e-5)
    assert result.advantages.dtype == jnp.float32


def test_vmap_over_an_extra_batch_axis():
    """Stacking E batches of the same group layout and vmapping gives each batch's own result."""
    stacked = [_inputs(seed) for seed in range(3)]
    _, _, ids, count = stacked[0]
    names = ("rewards", "response_mask", "log_probs", "sum_pi_squared")
    batches = {name: jnp.stack([inputs[1][name] for inputs in stacked]) for name in names}

    def one(rewards, mask, log_probs, spp):
        return otb_jax.optimal_token_baseline(rewards, mask, ids, count, log_probs, spp).advantages

    mapped = jax.vmap(one)(*(batches[name] for name in names))
    for e, inputs in enumerate(stacked):
        direct = one(*(inputs[1][name] for name in names))
        np.testing.assert_allclose(np.asarray(mapped[e]), np.asarray(direct), rtol=1e-6, atol=1e-6)


def test_inside_a_callers_jit_values_are_not_checked_but_results_agree():
    _, arrays, ids, count = _inputs()

    @jax.jit
    def step(rewards, mask, log_probs, spp):
        return otb_jax.multi_turn_optimal_token_baseline(rewards, mask, ids, count, log_probs, spp).advantages

    eager = otb_jax.multi_turn_optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, count,
                                                      arrays["log_probs"], arrays["sum_pi_squared"]).advantages
    np.testing.assert_allclose(np.asarray(step(arrays["rewards"], arrays["response_mask"], arrays["log_probs"],
                                               arrays["sum_pi_squared"])), np.asarray(eager), rtol=1e-6, atol=1e-6)


def test_inside_a_callers_jit_closed_over_concrete_arrays_are_not_checked_either():
    """Arrays bound into the traced function (a closure, functools.partial) are concrete, but the value checks'
    reductions on them are traced: they go unchecked, as traced arguments do, instead of a TracerBoolConversionError
    (every function with a value check; the results agree with the eager call's)."""
    import jax.numpy as jnp

    _, arrays, ids, count = _inputs()
    rng = np.random.default_rng(4)
    logits = jnp.asarray(rng.normal(size=(3, 8)), jnp.float32)
    hidden, weight = jnp.asarray(rng.normal(size=(3, 4)), jnp.float32), jnp.asarray(rng.normal(size=(8, 4)))
    token_ids = jnp.asarray([0, 7, 3])
    calls = {
        "otb": lambda: otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, count,
                                                      arrays["log_probs"], arrays["sum_pi_squared"]).advantages,
        "Σπ²": lambda: otb_jax.sum_pi_squared(logits),
        "statistics": lambda: otb_jax.token_statistics_from_logits(logits, token_ids).log_probs,
        "fused": lambda: otb_jax.fused_linear_token_statistics(hidden, weight, token_ids).log_probs,
    }
    for name, call in calls.items():
        np.testing.assert_allclose(np.asarray(jax.jit(call)()), np.asarray(call()), rtol=1e-6, atol=1e-6,
                                   err_msg=name)


@pytest.mark.parametrize("function", ["optimal_token_baseline", "multi_turn_optimal_token_baseline",
                                      "leave_one_out_token_baseline"])
def test_under_jit_a_too_small_segment_count_gives_nan_rows_not_wrong_numbers(function):
    """Inside jit the ids are not checked: a num_segments smaller than the number of groups leaves the last group's
    rows without sums — NaN there, not plausible wrong values — and every other row as with the right count."""
    batch, arrays, ids, count = _inputs()
    assert count >= 2
    run = getattr(otb_jax, function)
    jitted = jax.jit(lambda r, m, s, lp, spp: run(r, m, s, count - 1, lp, spp))
    result = jitted(arrays["rewards"], arrays["response_mask"], ids, arrays["log_probs"], arrays["sum_pi_squared"])
    right = run(arrays["rewards"], arrays["response_mask"], ids, count, arrays["log_probs"], arrays["sum_pi_squared"])
    last = np.asarray(ids) == count - 1
    for got, expected in ((result.advantages, right.advantages), (result.baselines, right.baselines)):
        got, expected = np.asarray(got), np.asarray(expected)
        assert np.isnan(got[last]).all()
        np.testing.assert_array_equal(got[~last], expected[~last])
    np.testing.assert_array_equal(np.asarray(result.returns), np.asarray(right.returns))


def test_float64_with_x64_enabled():
    batch = example_batch()
    ids, count = otb_jax.segment_ids(batch.group_ids)
    with jax.enable_x64(True):
        arrays = [jnp.asarray(np.asarray(getattr(batch, name), dtype=np.float64))
                  for name in ("rewards", "response_mask", "log_probs", "sum_pi_squared")]
        result = otb_jax.leave_one_out_token_baseline(arrays[0], arrays[1], jnp.asarray(ids), count, arrays[2],
                                                      arrays[3])
        assert result.advantages.dtype == jnp.float64
        expected = otb.leave_one_out_token_baseline(batch.rewards, batch.response_mask, batch.group_ids,
                                                    batch.log_probs, batch.sum_pi_squared)
        np.testing.assert_allclose(np.asarray(result.advantages), expected.advantages, rtol=1e-12, atol=1e-12)


@pytest.mark.bitexact
def test_more_segments_than_groups_changes_nothing():
    _, arrays, ids, count = _inputs()
    exact = otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, count,
                                           arrays["log_probs"], arrays["sum_pi_squared"]).advantages
    padded = otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, 16,
                                            arrays["log_probs"], arrays["sum_pi_squared"]).advantages
    np.testing.assert_array_equal(np.asarray(exact), np.asarray(padded))


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
def test_online_sum_pi_squared_matches_the_direct_pass(chunk):
    z = np.random.default_rng(3).normal(scale=6.0, size=(5, 4, 100)).astype(np.float32)
    z[0, 0, :60] = -np.inf                                         # whole chunks of excluded tokens
    direct = otb_jax.sum_pi_squared(jnp.asarray(z))
    streamed = otb_jax.sum_pi_squared(jnp.asarray(z), vocab_chunk=chunk)
    np.testing.assert_allclose(np.asarray(streamed), np.asarray(direct), rtol=2e-6)
    np.testing.assert_allclose(np.asarray(direct), otb.sum_pi_squared(z), rtol=2e-6)


def test_bfloat16_logits_are_accumulated_in_float32():
    z = jnp.asarray(np.random.default_rng(4).normal(scale=8.0, size=(6, 300)), dtype=jnp.bfloat16)
    result = otb_jax.sum_pi_squared(z)
    assert result.dtype == jnp.bfloat16
    exact = otb.sum_pi_squared(np.asarray(z.astype(jnp.float32)))
    np.testing.assert_allclose(np.asarray(result.astype(jnp.float32)), exact, rtol=2 * 2**-8)


def test_errors_name_the_argument():
    batch, arrays, ids, count = _inputs()
    bad = np.asarray(arrays["response_mask"]).copy()
    bad[0, 0] = 3.0
    with pytest.raises(ValueError, match="response_mask: values must be exactly 0 or 1"):
        otb_jax.optimal_token_baseline(arrays["rewards"], jnp.asarray(bad), ids, count, arrays["log_probs"],
                                       arrays["sum_pi_squared"])
    with pytest.raises(ValueError, match=r"segment_ids: ids must lie in \[0, 1\)"):
        otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, 1, arrays["log_probs"],
                                       arrays["sum_pi_squared"])
    with pytest.raises(ValueError, match="num_segments: expected a positive Python int"):
        otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, 0, arrays["log_probs"],
                                       arrays["sum_pi_squared"])
    with pytest.raises(TypeError, match="segment_ids: expected integer segment ids"):
        otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids.astype(jnp.float32), count,
                                       arrays["log_probs"], arrays["sum_pi_squared"])
    with pytest.raises(ValueError, match=r"log_probs: expected shape \(6, 8\)"):
        otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, count,
                                       arrays["log_probs"][:, :3], arrays["sum_pi_squared"])
    with pytest.raises(ValueError, match="sum_pi_squared: must lie in"):
        otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, count, arrays["log_probs"],
                                       arrays["sum_pi_squared"] + 2.0)
    with pytest.raises(ValueError, match=r"logits: every logit is -inf at position \(0,\)"):
        otb_jax.sum_pi_squared(jnp.full((2, 3), -jnp.inf))


@pytest.mark.parametrize("function", ["optimal_token_baseline", "multi_turn_optimal_token_baseline",
                                      "leave_one_out_token_baseline"])
def test_finite_rewards_whose_float32_sums_overflow_raise_naming_the_rewards(function):
    """Rewards of 10³⁷ over 64 positions: each return fits float32, the group sums Σᵢ GₜⁱWₜⁱ do not. The call
    raises, naming the rewards, instead of returning ±inf/NaN; under the caller's jit (values unchecked, as every
    value rule there) it returns them; 10³⁵ computes, finite."""
    rows, positions = 4, 64
    arguments = lambda scale: (jnp.zeros((rows, positions)).at[:, -1].set(  # noqa: E731
        jnp.asarray([1.0, 0.0, 0.5, 1.0]) * scale), jnp.ones((rows, positions)), jnp.zeros(rows, jnp.int32), 1,
        jnp.full((rows, positions), -2.5), jnp.full((rows, positions), 0.05))
    call = getattr(otb_jax, function)
    assert bool(jnp.isfinite(call(*arguments(1e35)).advantages).all())
    with pytest.raises(ValueError, match=r"^rewards: finite, but OTB's arithmetic overflows float32"):
        call(*arguments(1e37))
    traced = jax.jit(lambda r: call(r, *arguments(1e37)[1:]).advantages)
    assert not bool(jnp.isfinite(traced(arguments(1e37)[0])).all())


@pytest.mark.parametrize("function", ["optimal_token_baseline", "leave_one_out_token_baseline"])
def test_importance_weights_whose_squares_overflow_are_named(function):
    """ρ = 10²⁰ at one valid token in float32: ρ² and the realized energy leave float32 — the error names is_weights,
    not the rewards; ρ = 10¹⁵ still computes, finite."""
    rewards = jnp.zeros((4, 16)).at[:, -1].set(jnp.asarray([1.0, 0.0, 1.0, 0.0]))
    arguments = (rewards, jnp.ones((4, 16)), jnp.zeros(4, jnp.int32), 1, jnp.full((4, 16), -2.5),
                 jnp.full((4, 16), 0.05))
    call = getattr(otb_jax, function)
    assert bool(jnp.isfinite(call(*arguments, is_weights=jnp.ones((4, 16)).at[1, 3].set(1e15)).advantages).all())
    with pytest.raises(ValueError, match=r"^is_weights: finite, but the realized energy .* float32's range "
                                         r"\(ρ up to 1e\+20\)"):
        call(*arguments, is_weights=jnp.ones((4, 16)).at[1, 3].set(1e20))


@pytest.mark.parametrize("function", ["optimal_token_baseline", "leave_one_out_token_baseline"])
def test_float16_rewards_whose_results_leave_float16_raise_naming_them(function):
    """float16 rewards whose returns-to-go (9·10⁴) leave float16's range (±65504): the error names the rewards and
    the dtype (it said the float32 arithmetic overflowed); 2·10⁴ (returns up to 4·10⁴) computes, finite."""
    call = getattr(otb_jax, function)

    def rewards(scale):
        last = jnp.asarray(np.array([2.0, 2.0, 0.0, 1.0]) * scale, jnp.float16)
        return jnp.zeros((4, 8), jnp.float16).at[:, -1].set(last).at[:, -2].set(jnp.float16(scale))
    arguments = (jnp.ones((4, 8)), jnp.zeros(4, jnp.int32), 1, jnp.full((4, 8), -1.0), jnp.full((4, 8), 0.3))
    assert bool(jnp.isfinite(call(rewards(2e4), *arguments).returns).all())
    with pytest.raises(ValueError, match=r"^rewards: finite, but OTB's results leave float16's range \(±65504\)"):
        call(rewards(3e4), *arguments)


def test_returns_and_energy_helpers_raise_where_their_results_overflow():
    """otb_jax.returns_to_go and realized_energy_of: float16 rewards whose returns-to-go leave float16, float32
    rewards whose sums leave float32, ρ² beyond float32 — each names its argument (they returned ±inf)."""
    mask = jnp.ones((2, 4))
    half = jnp.zeros((2, 4), jnp.float16).at[:, -2:].set(jnp.asarray([3e4, 6e4], jnp.float16))
    with pytest.raises(ValueError, match=r"^rewards: finite, but OTB's results leave float16's range"):
        otb_jax.returns_to_go(half, mask)
    with pytest.raises(ValueError, match=r"^rewards: finite, but their returns-to-go .* overflow float32"):
        otb_jax.returns_to_go(jnp.full((2, 4), 2e38), mask)
    with pytest.raises(ValueError, match=r"^is_weights: finite, but the realized energy .* float32's range"):
        otb_jax.realized_energy_of(jnp.full((2, 4), -1.0), jnp.full((2, 4), 0.3), mask,
                                   is_weights=jnp.full((2, 4), 1e20))


@pytest.mark.gpu
@requires_jax_gpu
def test_gpu_matches_cpu():
    batch, arrays, ids, count = _inputs()
    gpu = jax.devices("gpu")[0]
    on_gpu = {name: jax.device_put(value, gpu) for name, value in arrays.items()}
    result = otb_jax.optimal_token_baseline(on_gpu["rewards"], on_gpu["response_mask"], jax.device_put(ids, gpu),
                                            count, on_gpu["log_probs"], on_gpu["sum_pi_squared"])
    cpu = otb_jax.optimal_token_baseline(arrays["rewards"], arrays["response_mask"], ids, count, arrays["log_probs"],
                                         arrays["sum_pi_squared"])
    np.testing.assert_allclose(np.asarray(result.advantages), np.asarray(cpu.advantages), rtol=1e-5, atol=1e-5)


def test_token_ids_outside_the_vocabulary_give_nan_under_jit_not_another_tokens_log_prob():
    """Traced (or unchecked) ids outside [0, V): log π = NaN there, as the fused function gives — a negative id used
    to wrap around to token V − 1's log π, a wrong number with no error; concrete ids are rejected by name."""
    import jax.numpy as jnp

    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 4)), dtype=jnp.float32)
    statistics = jax.jit(lambda z, ids: otb_jax.token_statistics_from_logits(z, ids).log_probs)
    for bad in (-1, 4):
        got = np.asarray(statistics(logits, jnp.asarray([1, bad])))
        expected = otb.token_statistics_from_logits(np.asarray(logits, np.float64), np.array([1, 2])).log_probs
        assert np.isnan(got[1]) and abs(got[0] - expected[0]) < 1e-6, (bad, got)
        unchecked = otb_jax.token_statistics_from_logits(logits, jnp.asarray([1, bad]), check_values=False)
        assert np.isnan(np.asarray(unchecked.log_probs)[1])
        with pytest.raises(ValueError, match=r"^token_ids: must lie in \[0, 4\)"):
            otb_jax.token_statistics_from_logits(logits, jnp.asarray([1, bad]))


@pytest.mark.parametrize("option", ["epsilon", "handle_zero_tail"])
def test_a_traced_option_is_named_as_needing_to_be_static(option):
    batch = example_batch()
    arguments = (batch.rewards, batch.response_mask, np.asarray([0, 1, 0, 1, 0, 1]), batch.log_probs,
                 batch.sum_pi_squared)
    value = 0.0 if option == "epsilon" else True

    def call(traced):
        return otb_jax.optimal_token_baseline(*arguments[:3], 2, *arguments[3:], **{option: traced}).advantages

    with pytest.raises(TypeError, match=rf"^{option}: expected a static Python value, got a traced one"):
        jax.jit(call)(value)


def test_the_vocabulary_chunk_may_be_a_numpy_integer():
    logits = np.random.default_rng(1).normal(size=(3, 10)).astype(np.float32)
    np.testing.assert_allclose(np.asarray(otb_jax.sum_pi_squared(logits, vocab_chunk=np.int64(4))),
                               np.asarray(otb_jax.sum_pi_squared(logits, vocab_chunk=4)), rtol=0, atol=0)
