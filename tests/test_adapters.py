"""One property suite for every backend: the NumPy reference, the torch port (CPU, CUDA when present, eager and
torch.compile) and the JAX port (CPU, GPU when present, jit and no-jit) — parametrized over adapters, not copied.

Select backends with ``OTB_ADAPTERS=torch-cpu,jax-cpu`` (default: every registered one; those that cannot run here —
framework not installed, no GPU — are skipped with the reason). Every comparison with the reference uses
``otb_comparison_tolerance``: the backend's forward error bound in its compute dtype plus the reference's.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import otb_spec as otb
from forced_openings import forced_opening_with_one_deviant, groups_outside, returns_range
from otb_spec import strategies as otb_st
from otb_spec.adapters import _REGISTRY, available_adapters, load_adapter
from otb_spec.tolerances import (logit_spread, logsumexp_tolerance, otb_comparison_tolerance, output_rounding,
                                 sum_pi_squared_tolerance, summation_tolerance)

available_adapters(runnable_only=False)          # merges adapters registered through entry points into the registry
_SELECTED = [name.strip() for name in os.environ.get("OTB_ADAPTERS", "").split(",") if name.strip()]
_NAMES = _SELECTED or list(_REGISTRY)
_GPU = {"torch-cuda", "jax-gpu"}

VARIANTS = {
    "single_turn": ("optimal_token_baseline", otb.optimal_token_baseline, dict(align="position")),
    "multi_turn": ("multi_turn_optimal_token_baseline", otb.multi_turn_optimal_token_baseline,
                   dict(align="valid_token")),
    "leave_one_out": ("leave_one_out_token_baseline", otb.leave_one_out_token_baseline,
                      dict(align="position", leave_one_out=True, handle_zero_tail=False)),
    "leave_one_out_multi_turn": ("leave_one_out_token_baseline", otb.leave_one_out_token_baseline,
                                 dict(align="valid_token", leave_one_out=True, handle_zero_tail=False)),
}
# what each variant passes besides the test's options (leave-one-out takes its alignment as an argument)
_CALL_OPTIONS = {"leave_one_out": dict(align="position"), "leave_one_out_multi_turn": dict(align="valid_token")}


def _adapter_params():
    params = []
    for name in _NAMES:
        marks = [pytest.mark.gpu] if name in _GPU else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


_CACHE: dict[str, object] = {}

# Adapters that run the same port as another one, only slower (JAX op by op runs the jit port's functions without
# tracing): they run every fixed case here (realistic layouts, bf16, the fixed identity cases) but leave the generated
# Hypothesis properties to the fast twin, which keeps the default run inside CI's time (tests/conftest.py applies it
# at collection). OTB_ADAPTERS=jax-cpu-nojit selects one explicitly and runs everything on it.
FIXED_CASES_ONLY = {"jax-cpu-nojit": "jax-cpu"}
SELECTED = _SELECTED


@pytest.fixture(scope="module", params=_adapter_params())
def adapter(request):
    name = request.param
    spec = _REGISTRY.get(name)
    if spec is None:
        pytest.skip(f"{name}: not a registered adapter")
    if not spec.installed():
        pytest.skip(f"{name}: needs {', '.join(spec.requires)} (not installed)")
    if not spec.runnable():
        pytest.skip(f"{name}: cannot run on this machine (no GPU)")
    if name not in _CACHE:
        _CACHE[name] = load_adapter(name)
    return _CACHE[name]


def _as_seen(adapter, array, dtype):
    """The values the backend actually receives (e.g. rounded to bfloat16), in the precision they were rounded to
    (float32 for half precision, which NumPy lacks), so the reference applies that precision's input slack."""
    return np.asarray(adapter.to_numpy(adapter.asarray(array, dtype)))


def _run(adapter, variant, batch, dtype, **options):
    """Run a variant on the backend; return (advantages, returns, inputs as seen) as NumPy."""
    method, _, _ = VARIANTS[variant]
    options = {**_CALL_OPTIONS.get(variant, {}), **options}
    seen = {name: _as_seen(adapter, getattr(batch, name), dtype)
            for name in ("rewards", "log_probs", "sum_pi_squared")}
    seen["is_weights"] = None if batch.is_weights is None else _as_seen(adapter, batch.is_weights, dtype)
    mask = np.asarray(batch.response_mask, dtype=np.float64)
    arrays = {name: None if value is None else adapter.asarray(value, dtype) for name, value in seen.items()}
    advantages, returns = getattr(adapter, method)(
        arrays["rewards"], adapter.asarray(mask, dtype), adapter.segments(batch.group_ids), arrays["log_probs"],
        arrays["sum_pi_squared"], is_weights=arrays["is_weights"], **options)
    return (np.asarray(adapter.to_numpy(advantages), dtype=np.float64),
            np.asarray(adapter.to_numpy(returns), dtype=np.float64), seen, mask)


def _reference(variant, seen, mask, group_ids, **options):
    _, function, _ = VARIANTS[variant]
    options = {**_CALL_OPTIONS.get(variant, {}), **options}
    return function(seen["rewards"], mask, group_ids, seen["log_probs"], seen["sum_pi_squared"],
                    is_weights=seen["is_weights"], **options)


def _tolerances(adapter, variant, seen, mask, group_ids, dtype, **options):
    """The bound for this adapter against the reference; leave-one-out judged as weighing by max(W, 0), which every
    adapter here claims (``clamped_weights``)."""
    _, _, bound_options = VARIANTS[variant]
    bound_options = dict(bound_options)
    bound_options.setdefault("handle_zero_tail", options.get("handle_zero_tail", True))
    return otb_comparison_tolerance(seen["rewards"], mask, group_ids, seen["log_probs"], seen["sum_pi_squared"],
                                    is_weights=seen["is_weights"], epsilon=options.get("epsilon", 1e-8),
                                    compute_dtype=adapter.compute_dtype(dtype), output_dtype=dtype,
                                    clamped_weights=True, **bound_options)


# ----------------------------------------------------------------------------------------------------------------------
# equivalence with the reference


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
@given(batch=otb_st.rollout_batches(), handle_zero_tail=st.booleans(), epsilon=st.sampled_from([1e-8, 0.0, 1e-3]))
def test_otb_matches_the_reference(adapter, variant, dtype, batch, handle_zero_tail, epsilon):
    options = {"epsilon": epsilon}
    if not variant.startswith("leave_one_out"):
        options["handle_zero_tail"] = handle_zero_tail
    advantages, returns, seen, mask = _run(adapter, variant, batch, dtype, **options)
    expected = _reference(variant, seen, mask, batch.group_ids, **options)
    advantages_tolerance, returns_tolerance = _tolerances(adapter, variant, seen, mask, batch.group_ids, dtype,
                                                          **options)
    returns_tolerance.assert_close(returns, expected.returns, f"{adapter.name} {variant} returns")
    advantages_tolerance.assert_close(advantages, expected.advantages, f"{adapter.name} {variant} advantages")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@settings(max_examples=20)
@given(batch=otb_st.rollout_batches(max_abs_reward=4.0))
def test_half_precision_inputs_are_accumulated_in_float32(adapter, dtype, batch):
    """bf16/fp16 inputs: the backend sees rounded values; it must match the reference on exactly those values within
    the float32 bound plus the rounding of the output to the half-precision dtype."""
    if adapter.name == "numpy-reference":
        pytest.skip("the reference reads half precision through NumPy (tested in test_proxy / test_otb_properties)")
    advantages, returns, seen, mask = _run(adapter, "single_turn", batch, dtype)
    assume(np.all(seen["sum_pi_squared"] <= 1.0 + 3e-2))           # rounding may not leave the accepted range
    expected = _reference("single_turn", seen, mask, batch.group_ids)
    advantages_tolerance, _ = _tolerances(adapter, "single_turn", seen, mask, batch.group_ids, dtype)
    advantages_tolerance.assert_close(advantages, expected.advantages, f"{adapter.name} {dtype} advantages")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@given(logits=st.one_of(otb_st.logits((3, 4), max_vocab_size=64, extreme=False),
                        otb_st.logits((2, 3), max_vocab_size=64, extreme=True),
                        otb_st.logits((5,), max_vocab_size=64, allow_neg_inf=True)))
def test_sum_pi_squared_matches_the_reference(adapter, dtype, logits):
    seen = _as_seen(adapter, logits, dtype)
    assume(np.isfinite(seen).any(axis=-1).all() and not np.isnan(seen).any() and not (seen == np.inf).any())
    got = np.asarray(adapter.to_numpy(adapter.sum_pi_squared(adapter.asarray(seen, dtype))), dtype=np.float64)
    # the verifier's rule (Case.tolerances): any correct evaluation — shifted or not (verl's exp(lse(2z) − 2·lse(z)))
    # — in the input's precision with sums in the adapter's compute dtype, plus the reference's own float64 bound
    tolerance = (sum_pi_squared_tolerance(seen, dtype=dtype, accumulation_dtype=adapter.compute_dtype(dtype))
                 + logsumexp_tolerance(seen.shape[-1], logit_spread(seen)) + output_rounding(dtype))
    tolerance.assert_close(got, otb.sum_pi_squared(seen), f"{adapter.name} Σπ²")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@given(logits=otb_st.logits((4, 3), max_vocab_size=48, extreme=None), data=st.data())
def test_fused_token_statistics_match_the_reference(adapter, dtype, logits, data):
    if not callable(getattr(adapter, "token_statistics_from_logits", None)):
        pytest.skip(f"{adapter.name}: optional token_statistics_from_logits not provided")
    seen = _as_seen(adapter, logits, dtype)
    vocab = seen.shape[-1]
    ids = np.array(data.draw(st.lists(st.integers(0, vocab - 1), min_size=12, max_size=12), label="ids")).reshape(4, 3)
    got = [np.asarray(adapter.to_numpy(x), dtype=np.float64)
           for x in adapter.token_statistics_from_logits(adapter.asarray(seen, dtype), adapter.asarray(ids, "int64"))]
    expected = otb.token_statistics_from_logits(seen, ids)
    compute = adapter.compute_dtype(dtype)
    magnitude = float(np.abs(seen).max()) + np.log(vocab) + 1.0
    absolute = (summation_tolerance(4 * vocab, magnitude, compute) + summation_tolerance(4 * vocab, magnitude)
                + output_rounding(dtype))
    absolute.assert_close(got[0], expected.log_probs, f"{adapter.name} log π(y)")
    absolute.assert_close(got[1], expected.entropy, f"{adapter.name} entropy")
    spread = float(seen.max() - seen.min())
    (logsumexp_tolerance(vocab, spread, compute) + logsumexp_tolerance(vocab, spread) + output_rounding(dtype)
     ).assert_close(got[2], expected.sum_pi_squared, f"{adapter.name} Σπ²")


# ----------------------------------------------------------------------------------------------------------------------
# identities every backend must satisfy on its own


@given(batch=otb_st.rollout_batches(), variant=st.sampled_from(sorted(VARIANTS)))
def test_masked_positions_are_exactly_zero(adapter, batch, variant):
    advantages, _, _, mask = _run(adapter, variant, batch, "float32")
    assert np.all(advantages[mask == 0] == 0.0)
    assert np.isfinite(advantages).all()


@pytest.mark.parametrize("align", ["turn", ["position"], np.array(["position"]), None],
                         ids=["unknown", "list", "array", "none"])
def test_an_alignment_other_than_the_two_names_is_rejected_naming_it(adapter, align):
    """Every backend checks ``align`` as the reference does (one shared check): only the strings "position" and
    "valid_token" — a list or array holding one (whose ``in`` test is ambiguous) gets the same message."""
    rng = np.random.default_rng(0)
    inputs = [adapter.asarray(value, "float32") for value in (rng.random((2, 3)), np.ones((2, 3)),
                                                              np.full((2, 3), np.log(0.5)), np.full((2, 3), 0.5))]
    with pytest.raises(ValueError, match=r"^align: expected one of \('position', 'valid_token'\)"):
        adapter.leave_one_out_token_baseline(inputs[0], inputs[1], adapter.segments(np.array([0, 0])), inputs[2],
                                             inputs[3], align=align)


@given(batch=otb_st.rollout_batches(padding="right", holes=False, empty_rows=False))
def test_multi_turn_equals_single_turn_on_prefix_masks(adapter, batch):
    single, _, seen, mask = _run(adapter, "single_turn", batch, "float32")
    multi, _, _, _ = _run(adapter, "multi_turn", batch, "float32")
    tolerance, _ = _tolerances(adapter, "single_turn", seen, mask, batch.group_ids, "float32")
    (tolerance + tolerance).assert_close(multi, single, f"{adapter.name} multi-turn vs single-turn")


@given(batch=otb_st.rollout_batches(), data=st.data())
def test_permuting_the_batch_permutes_the_advantages(adapter, batch, data):
    order = np.array(data.draw(st.permutations(range(batch.batch_size)), label="permutation"))
    permuted = otb.RolloutBatch(**{name: None if getattr(batch, name) is None else np.asarray(getattr(batch, name))[
        order] for name in ("rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared", "is_weights")})
    original, _, seen, mask = _run(adapter, "single_turn", batch, "float32")
    shuffled, _, _, _ = _run(adapter, "single_turn", permuted, "float32")
    tolerance, _ = _tolerances(adapter, "single_turn", seen, mask, batch.group_ids, "float32")
    shifted = type(tolerance)(tolerance.rtol, np.asarray(tolerance.atol)[order], tolerance.reason)
    (shifted + shifted).assert_close(shuffled, original[order], f"{adapter.name} permutation")


@given(batch=otb_st.rollout_batches(min_group_size=2, max_group_size=2, is_weights=False))
def test_leave_one_out_with_two_members_is_the_other_return(adapter, batch):
    """N = 2, ε = 0: where the other member is valid with energy, the baseline is its return: A = Gᵢ − Gⱼ."""
    advantages, returns, seen, mask = _run(adapter, "leave_one_out", batch, "float64", epsilon=0.0)
    expected = _reference("leave_one_out", seen, mask, batch.group_ids, epsilon=0.0)
    tolerance, _ = _tolerances(adapter, "leave_one_out", seen, mask, batch.group_ids, "float64", epsilon=0.0)
    tolerance.assert_close(advantages, expected.advantages, f"{adapter.name} leave-one-out N = 2")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("variant", ["leave_one_out", "leave_one_out_multi_turn"])
def test_leave_one_out_stays_bounded_where_energies_are_negative(adapter, variant, dtype):
    """A forced opening (π → 1) whose statistics sit within the input slack below π² (Σπ² = π² − 10⁻³ in float32,
    π² − 10⁻⁹ in float64, both accepted): w < 0 there, so every member's W is negative for 6 tokens and the other
    members' energy D is negative. The baseline is then 0 (A = G; others_denominator), as the reference says — not
    N/ε (10⁵ and more in float32 with ε = 10⁻⁸: the clamp max(D, 0) before 2026-11-27); after the opening the
    baseline is a weighted mean of the others' returns again, so |A| ≤ 2·max|G| everywhere."""
    rng = np.random.default_rng(11)
    rows, positions = 6, 16
    pi = rng.uniform(0.2, 0.9, size=(rows, positions))
    spp = pi**2 + (1 - pi) ** 2 * rng.uniform(0.1, 1.0, size=(rows, positions))
    opening, deficit = (0.999, 1e-3) if dtype == "float32" else (1 - 1e-5, 1e-9)
    pi[:, :6] = opening
    spp[:, :6] = pi[:, :6] ** 2 - deficit
    rewards = np.zeros((rows, positions))
    rewards[:, -1] = rng.integers(0, 2, size=rows)
    batch = otb.RolloutBatch(rewards=rewards, response_mask=np.ones((rows, positions)), log_probs=np.log(pi),
                             sum_pi_squared=spp, group_ids=np.array(["g", "h"] * 3, dtype=object))
    advantages, returns, seen, mask = _run(adapter, variant, batch, dtype)
    expected = _reference(variant, seen, mask, batch.group_ids)
    assert np.all(expected.baselines[:, :6] == 0.0)
    np.testing.assert_array_equal(advantages[:, :6], returns[:, :6])       # B = 0 (the verifier leaves it unjudged)
    assert np.abs(advantages).max() <= 2 * np.abs(returns).max() + 1e-6
    tolerance, _ = _tolerances(adapter, variant, seen, mask, batch.group_ids, dtype)
    tolerance.assert_close(advantages, expected.advantages, f"{adapter.name} {variant}, negative energies")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("variant", ["leave_one_out", "leave_one_out_multi_turn"])
def test_leave_one_out_stays_a_weighted_mean_where_energies_have_mixed_signs(adapter, variant, dtype):
    """A forced opening whose Σπ² sits within the input slack on either side of π² (π² ± 10⁻³ in float32, ± 10⁻⁹
    in float64, token by token: what bf16 or float32 rounding of Σπ² gives at confident tokens): the members' W
    there are tiny and of both signs, so the bare others' energy D₋ᵢ can be positive and far smaller than the terms
    it sums — the baseline N₋ᵢ/(D₋ᵢ + ε) was then 10¹–10⁴ times max|G| (before 2026-11-27). Leave-one-out weighs
    by W⁺ = max(W, 0), so every baseline is a weighted mean of the other members' returns (times D₋ᵢ/(D₋ᵢ + ε)):
    |B| ≤ max|G| up to the rounding of D − own, and |A| ≤ 2·max|G|; the verifier's tolerance still holds."""
    rng = np.random.default_rng(5)
    rows, positions, opening = 16, 12, 6
    pi = rng.uniform(0.2, 0.9, size=(rows, positions))
    spp = pi**2 + (1 - pi) ** 2 * rng.uniform(0.1, 1.0, size=(rows, positions))
    confident, slack = (0.999, 1e-3) if dtype == "float32" else (1 - 1e-5, 1e-9)
    pi[:, :opening] = confident
    spp[:, :opening] = pi[:, :opening] ** 2 + slack * rng.choice([-1.0, 1.0], size=(rows, opening))
    rewards = np.zeros((rows, positions))
    rewards[:, -1] = rng.integers(0, 2, size=rows)
    batch = otb.RolloutBatch(rewards=rewards, response_mask=np.ones((rows, positions)), log_probs=np.log(pi),
                             sum_pi_squared=spp, group_ids=np.repeat(["g", "h"], rows // 2).astype(object))
    advantages, returns, seen, mask = _run(adapter, variant, batch, dtype)
    expected = _reference(variant, seen, mask, batch.group_ids)
    largest = np.abs(returns).max()
    assert np.abs(expected.baselines).max() <= largest * (1 + 1e-6)
    assert np.abs(advantages).max() <= 2 * largest * (1 + 1e-6), f"max |A| = {np.abs(advantages).max():.3g}"
    tolerance, _ = _tolerances(adapter, variant, seen, mask, batch.group_ids, dtype)
    tolerance.assert_close(advantages, expected.advantages, f"{adapter.name} {variant}, mixed-sign energies")


@pytest.mark.parametrize("variant", ["leave_one_out", "leave_one_out_multi_turn"])
def test_leave_one_out_of_a_member_whose_energy_dwarfs_the_others_stays_a_weighted_mean(adapter, variant):
    """A forced opening where one member of 8 sampled another token (forced_opening_with_one_deviant), in float32:
    at t = 0 that member's W ≈ 2 against the others' total of 10⁻⁷ or less, so D − Wᵢ cancels to rounding noise of
    either sign, and its baseline left [min(G, 0), max(G, 0)] (the ε-shrunk weighted mean it must be) in 19 of 3000
    groups with the native kernel, 35 eager, 13 with JAX (worst |B| = 2.8·max|G|). A member whose weight is most of
    the column's takes the others' sums added directly (otb_torch._core.others_sums, FN(otb_top) in the native
    kernel, otb_jax's token_baseline, and across ranks otb_torch.distributed's _sums_without_dominant): none leaves
    it now, here over 400 groups."""
    batch = forced_opening_with_one_deviant(400)
    advantages, returns, seen, mask = _run(adapter, variant, batch, "float32")
    baselines = returns - advantages
    outside = groups_outside(baselines, batch.group_ids, *returns_range(returns, batch.group_ids, 400))
    assert not outside, f"{len(outside)} groups, worst |B| = {np.abs(baselines).max():.3g}"
    expected = _reference(variant, seen, mask, batch.group_ids)
    tolerance, _ = _tolerances(adapter, variant, seen, mask, batch.group_ids, "float32")
    tolerance.assert_close(advantages, expected.advantages, f"{adapter.name} {variant}, one deviant member")


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("variant", ["leave_one_out", "leave_one_out_multi_turn"])
def test_leave_one_out_with_tied_weights_matches_the_reference(adapter, variant, dtype):
    """Members with the same statistics have the same W at every column: ties for the largest weight, with equal
    returns (the same G·W too) and with different ones, next to a member whose first tokens dominate the column.
    A port that sets its largest member apart (the native kernel's FN(otb_top)) must tell the member it set apart
    from its twins; every member's baseline is the reference's within the bound."""
    rows, positions = 7, 12
    rng = np.random.default_rng(4)
    pi = np.repeat(rng.uniform(0.05, 0.2, size=(1, positions)), rows, axis=0)   # twins: the largest W from t ≈ 6 …
    pi[:, :3] = 0.99                                               # … after a confident opening, small energies …
    pi[6, :3], pi[6, 3:] = 0.05, 0.99                              # … where the last member dominates, and only there
    spp = pi**2 + (1 - pi) ** 2 * 0.5
    rewards = np.zeros((rows, positions))
    rewards[:, -1] = [1.0, 1.0, 0.0, 0.0, 1.0, 0.5, 0.25]          # twins in W and G·W (0, 1, 4), in W only (2, 5)
    batch = otb.RolloutBatch(rewards=rewards, response_mask=np.ones((rows, positions)), log_probs=np.log(pi),
                             sum_pi_squared=spp, group_ids=np.zeros(rows, dtype=np.int64))
    advantages, returns, seen, mask = _run(adapter, variant, batch, dtype)
    expected = _reference(variant, seen, mask, batch.group_ids)
    tolerance, _ = _tolerances(adapter, variant, seen, mask, batch.group_ids, dtype)
    assert tolerance.checked_fraction() == 1.0
    tolerance.assert_close(advantages, expected.advantages, f"{adapter.name} {variant}, tied weights")


# ----------------------------------------------------------------------------------------------------------------------
# the layouts trainers produce (verl: groups scattered by balance_batch, unequal sizes from dynamic sampling)


def realistic_batch(seed: int, sizes: list[int], positions: int, *, scattered: bool = True, holes: bool = False,
                    empty_rows: int = 0, is_weights: bool = False, tied_longest: bool = True) -> otb.RolloutBatch:
    """A verl-like batch: string uids in an object array, rows in a random permutation (``scattered``, as after
    ``balance_batch``) or group by group, right-padded masks of random lengths (with tool-output ``holes`` for
    multi-turn), ``empty_rows`` rows with no valid token (first all members but one of the largest group, which
    multi-turn OTB then treats as a singleton), consistent token statistics (π² ≤ Σπ² = π² + (1 − π)²u ≤ 1,
    log π ≤ 0), a terminal 0/1 reward plus small dense rewards, arbitrary finite junk at masked positions, and (with
    ``tied_longest``) some groups whose two longest members tie, so both branches of the zero-tail rule occur."""
    rng = np.random.default_rng(seed)
    rows = sum(sizes)
    group_ids = np.array([f"{seed:04d}-{group:05d}-uid" for group, size in enumerate(sizes) for _ in range(size)],
                         dtype=object)
    lengths = rng.integers(1, positions + 1, size=rows)
    first = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    if tied_longest:
        for start, size in zip(first[::3], np.asarray(sizes)[::3]):
            if size >= 2:
                lengths[start + 1] = lengths[start] = lengths[start:start + size].max()
    if empty_rows:                  # first, all members but one of the largest group: a group with a single member
        largest = int(np.argmax(sizes))
        emptied = np.arange(first[largest] + 1, first[largest] + sizes[largest])[:empty_rows]
        others = np.setdiff1d(np.arange(rows), np.arange(first[largest], first[largest] + sizes[largest]))
        lengths[np.concatenate((emptied, rng.choice(others, size=empty_rows - emptied.size, replace=False)))] = 0
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float64)
    if holes:
        for row in np.flatnonzero(lengths > 4):
            begin = rng.integers(1, lengths[row] - 2)
            mask[row, begin:begin + rng.integers(1, lengths[row] - begin)] = 0.0      # keeps the last valid token
    pi = rng.beta(5.0, 1.0, size=(rows, positions))
    spp = pi**2 + (1.0 - pi) ** 2 * rng.uniform(0.0, 1.0, size=(rows, positions))
    rewards = 0.1 * rng.normal(size=(rows, positions)) * mask
    last = np.where(lengths > 0, positions - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
    rewards[np.arange(rows), last] += rng.integers(0, 2, size=rows) * (lengths > 0)
    junk = rng.uniform(-3.0, 3.0, size=(4, rows, positions))
    valid = mask > 0
    arrays = {"rewards": np.where(valid, rewards, junk[0]), "log_probs": np.where(valid, np.log(pi), junk[1]),
              "sum_pi_squared": np.where(valid, spp, junk[2]),
              "is_weights": np.where(valid, rng.uniform(0.0, 2.5, size=(rows, positions)), np.abs(junk[3]))}
    order = rng.permutation(rows) if scattered else np.arange(rows)
    return otb.RolloutBatch(rewards=arrays["rewards"][order], response_mask=mask[order], group_ids=group_ids[order],
                            log_probs=arrays["log_probs"][order], sum_pi_squared=arrays["sum_pi_squared"][order],
                            is_weights=arrays["is_weights"][order] if is_weights else None)


def unequal_sizes(seed: int, groups: int, largest: int = 8) -> list[int]:
    """Group sizes as dynamic sampling leaves them: 1 … largest, singletons included, at least one of each end."""
    sizes = np.random.default_rng(seed).integers(1, largest + 1, size=groups)
    sizes[:2] = (1, largest)
    return [int(size) for size in sizes]


LAYOUTS = {
    "scattered-equal": dict(sizes=[8] * 12),                                   # balance_batch over fixed-N groups
    "scattered-unequal": dict(sizes=unequal_sizes(1, 14), empty_rows=9, is_weights=True),  # … and dynamic sampling
    "grouped-unequal": dict(sizes=unequal_sizes(2, 14), scattered=False),     # dynamic sampling, no balancing
    "scattered-holes": dict(sizes=unequal_sizes(3, 12), holes=True, empty_rows=3),  # multi-turn tool outputs
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_realistic_layouts_match_the_reference(adapter, layout, variant):
    """Every variant on verl-like float32 batches — scattered rows, unequal and singleton groups, empty rows, IS
    weights, multi-turn masks with holes — equals the reference within the derived tolerances, with and without the
    zero tail (float64 is covered by test_otb_matches_the_reference)."""
    dtype = "float32"
    batch = realistic_batch(sorted(LAYOUTS).index(layout), positions=48, **LAYOUTS[layout])
    for options in ([{}] if variant.startswith("leave_one_out") else [{"handle_zero_tail": True},
                                                                      {"handle_zero_tail": False}]):
        advantages, returns, seen, mask = _run(adapter, variant, batch, dtype, **options)
        expected = _reference(variant, seen, mask, batch.group_ids, **options)
        advantages_tolerance, returns_tolerance = _tolerances(adapter, variant, seen, mask, batch.group_ids, dtype,
                                                              **options)
        returns_tolerance.assert_close(returns, expected.returns, f"{adapter.name} {variant} {layout} returns")
        advantages_tolerance.assert_close(advantages, expected.advantages,
                                          f"{adapter.name} {variant} {layout} {options} advantages")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_realistic_layouts_in_bfloat16(adapter, variant):
    """bf16 inputs in the scattered, unequal layout: the reference on the rounded values, within the float32 bound
    plus the output's rounding to bf16."""
    if adapter.name == "numpy-reference":
        pytest.skip("the reference reads half precision through NumPy (tested in test_proxy / test_otb_properties)")
    batch = realistic_batch(7, unequal_sizes(7, 12), 48, holes=variant.endswith("multi_turn"), is_weights=True)
    advantages, _, seen, mask = _run(adapter, variant, batch, "bfloat16")
    assert np.all(seen["sum_pi_squared"][mask > 0] <= 1.0 + 3e-2), "rounded Σπ² outside the accepted range"
    expected = _reference(variant, seen, mask, batch.group_ids)
    tolerance, _ = _tolerances(adapter, variant, seen, mask, batch.group_ids, "bfloat16")
    tolerance.assert_close(advantages, expected.advantages, f"{adapter.name} {variant} bfloat16 advantages")
