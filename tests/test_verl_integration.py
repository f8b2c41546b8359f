"""otb_torch.verl inside verl 0.9.1: verl's own ``compute_advantage`` on a ``DataProto`` built as verl's trainer builds
it, with verl's OTB estimators routed to otb_torch.

The batch follows ``RayPPOTrainer.fit`` (verl/trainer/ppo/ray_trainer.py): string uids as an object array
(ray_trainer.py:1482–1484), ``repeat(rollout.n, interleave=True)`` (:1540), ``_balance_batch`` — verl's own method —
reordering the rows (:1549–1550), then the actor's ``old_log_probs`` and ``sum_pi_squared`` (:1297–1322), the
token-level rewards and, when rollout correction is on, ``rollout_is_weights`` (:1643–1654); ``compute_advantage`` is
called as at :1667–1675. Some batches drop rows after the repeat (as group filtering and rejection sampling do), so
groups are unequal; multi-turn masks have holes where tool output was.

Every comparison uses the derived tolerances of ``otb_spec.tolerances``: two float32 implementations (ours, verl's)
differ by at most the sum of their forward error bounds (``otb_tolerance`` docstring) plus the rounding of each output;
ours against the float64 reference by ``otb_comparison_tolerance``. The meta-tests at the end show the comparisons
reject deliberately wrong estimators.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import types
import uuid
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
otb_torch = pytest.importorskip("otb_torch")

import otb_spec as otb  # noqa: E402
import otb_torch.verl as otb_verl  # noqa: E402  (imports without verl: test_imports_and_names_the_missing_package)
from otb_spec.tolerances import (  # noqa: E402
    Tolerance,
    logit_spread,
    logsumexp_tolerance,
    otb_comparison_tolerance,
    otb_tolerance,
    output_rounding,
    sum_pi_squared_tolerance,
)

ESTIMATORS = {"optimal_token_baseline": "position", "tir_optimal_token_baseline": "valid_token"}
ADAPTERS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "adapters")


@pytest.fixture(scope="module")
def verl():
    """verl 0.9.1's modules (skips, with the reason, when verl or one of its imports is missing)."""
    try:
        from verl.protocol import DataProto
        from verl.trainer.config import AlgoConfig
        from verl.trainer.ppo import core_algos
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage
        from verl.utils import torch_functional
    except ImportError as exc:
        pytest.skip(f"verl 0.9.1 is not importable here ({exc}); install the 'verl' test extra (README test command)")
    return SimpleNamespace(DataProto=DataProto, AlgoConfig=AlgoConfig, core_algos=core_algos,
                           RayPPOTrainer=RayPPOTrainer, compute_advantage=compute_advantage,
                           torch_functional=torch_functional)


@pytest.fixture(autouse=True)
def _nothing_installed_after_a_test():
    yield
    otb_verl.uninstall()


# ----------------------------------------------------------------------------------------------------------------------
# a batch as verl's trainer builds it


def _uids(rng: np.random.Generator, count: int) -> np.ndarray:
    """``np.array([str(uuid.uuid4()) ...], dtype=object)`` as ray_trainer.py:1482, from a seeded generator."""
    return np.array([str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range(count)], dtype=object)


def _response_masks(rng: np.random.Generator, rows: int, positions: int, multi_turn: bool
                    ) -> tuple[np.ndarray, np.ndarray]:
    """(response attention mask, response_mask), right-padded with random lengths; multi-turn responses alternate
    assistant turns (mask 1) and tool output (mask 0, attended)."""
    lengths = rng.integers(1, positions + 1, size=rows)
    attended = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float32)
    mask = attended.copy()
    if multi_turn:
        for row in range(rows):
            position, assistant = 0, True
            while position < lengths[row]:
                span = int(rng.integers(2, 12)) if assistant else int(rng.integers(1, 9))
                if not assistant:
                    mask[row, position:min(position + span, lengths[row] - 1)] = 0.0   # the last token is the model's
                position += span
                assistant = not assistant
    return attended, mask


def trainer_batch(verl, *, seed: int, prompts: int = 12, rollout_n: int = 6, positions: int = 96,
                  multi_turn: bool = False, is_weights: bool = False, unequal_groups: bool = False,
                  kl_in_reward: bool = False):
    """A DataProto with the keys ``compute_advantage`` reads, in the order verl's trainer produces them."""
    rng = np.random.default_rng(seed)
    prompt_lengths = rng.integers(4, 17, size=prompts)
    prompt_attention = (np.arange(16)[None, :] >= 16 - prompt_lengths[:, None]).astype(np.float32)   # left-padded
    batch = verl.DataProto.from_single_dict({"prompt_attention_mask": torch.from_numpy(prompt_attention),
                                             "uid": _uids(rng, prompts)})
    batch = batch.repeat(repeat_times=rollout_n, interleave=True)                       # ray_trainer.py:1540
    if unequal_groups:                                                                  # filtering / rejection
        keep = np.sort(rng.choice(len(batch), size=len(batch) - prompts, replace=False))
        batch = batch.select_idxs(keep)
    rows = len(batch)
    attended, response_mask = _response_masks(rng, rows, positions, multi_turn)
    batch.batch["attention_mask"] = torch.cat([batch.batch["prompt_attention_mask"], torch.from_numpy(attended)], -1)
    batch.batch["response_mask"] = torch.from_numpy(response_mask)
    order_before = batch.non_tensor_batch["uid"].copy()
    trainer = SimpleNamespace(_get_dp_size=lambda worker_group, role: 4, actor_rollout_wg=None,
                              use_prefix_grouper=False)
    verl.RayPPOTrainer._balance_batch(trainer, batch, metrics={})                       # ray_trainer.py:1549–1550
    assert not np.array_equal(batch.non_tensor_batch["uid"], order_before), "balance_batch left the order unchanged"

    response_mask = batch.batch["response_mask"].numpy()
    valid = response_mask > 0
    # the actor's token statistics (ray_trainer.py:1297–1322): π ≤ 1, π² ≤ Σπ² = π² + (1 − π)²·u ≤ 1; 0 on padding
    pi = np.clip(rng.beta(3.0, 1.0, size=response_mask.shape), 1e-4, 1.0)
    sum_pi_squared = pi**2 + (1 - pi) ** 2 * rng.uniform(size=pi.shape)
    batch.batch["old_log_probs"] = torch.from_numpy(np.where(valid, np.log(pi), 0.0).astype(np.float32))
    batch.batch["sum_pi_squared"] = torch.from_numpy(np.where(valid, sum_pi_squared, 0.0).astype(np.float32))
    # rewards: the score at the last response token (verl's reward managers), optionally minus a per-token KL term
    last = np.arange(response_mask.shape[1])[None, :] == (attended_length(batch) - 1)[:, None]
    rewards = np.where(last, rng.integers(0, 2, size=(rows, 1)), 0.0)
    if kl_in_reward:
        rewards = rewards - 0.05 * np.abs(rng.normal(size=rewards.shape)) * valid
    batch.batch["token_level_rewards"] = torch.from_numpy(rewards.astype(np.float32))
    if is_weights:                                                   # truncated IS weights ρ ∈ (0, 2], 0 on padding
        rho = np.minimum(np.exp(rng.normal(scale=0.4, size=response_mask.shape)), 2.0)
        batch.batch["rollout_is_weights"] = torch.from_numpy(np.where(valid, rho, 0.0).astype(np.float32))
    return batch


def attended_length(batch) -> np.ndarray:
    prompt_positions = batch.batch["prompt_attention_mask"].shape[1]
    return batch.batch["attention_mask"][:, prompt_positions:].sum(-1).numpy().astype(int)


def run_compute_advantage(verl, batch, estimator: str):
    """verl's own ``compute_advantage`` (ray_trainer.py:187) on a copy, as the trainer calls it (:1667–1675)."""
    data = copy.deepcopy(batch)
    data = verl.compute_advantage(data, adv_estimator=estimator, gamma=1.0, lam=1.0, num_repeat=6,
                                  norm_adv_by_std_in_grpo=True, config=verl.AlgoConfig(adv_estimator=estimator))
    return data.batch["advantages"].numpy(), data.batch["returns"].numpy()


def inputs_of(batch) -> dict:
    weights = batch.batch.get("rollout_is_weights", None)
    return dict(rewards=batch.batch["token_level_rewards"].numpy(), response_mask=batch.batch["response_mask"].numpy(),
                group_ids=batch.non_tensor_batch["uid"], log_probs=batch.batch["old_log_probs"].numpy(),
                sum_pi_squared=batch.batch["sum_pi_squared"].numpy(),
                is_weights=None if weights is None else weights.numpy())


def two_float32_implementations(batch, align: str) -> tuple[Tolerance, Tolerance]:
    """|ours − verl's| for two float32 implementations: each one's forward error bound, plus each output's rounding."""
    inputs = inputs_of(batch)
    arrays = [inputs.pop(name) for name in ("rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared")]
    bound = otb_tolerance(*arrays, align=align, dtype=np.float32, **inputs)
    rounding = output_rounding(np.float32)
    return bound[0] + bound[0] + rounding + rounding, bound[1] + bound[1] + rounding + rounding


BATCHES = {
    "single-turn": dict(seed=1),
    "single-turn, IS weights, unequal groups": dict(seed=2, is_weights=True, unequal_groups=True),
    "multi-turn holes, KL in reward": dict(seed=3, multi_turn=True, kl_in_reward=True),
    "multi-turn holes, IS weights, unequal groups": dict(seed=4, multi_turn=True, is_weights=True, unequal_groups=True),
}


def assert_route_to(verl, installation, estimator: str, function) -> None:
    routed = verl.core_algos.get_adv_estimator_fn(estimator)
    assert routed is installation.estimators[estimator] and routed.__wrapped__ is function


# ----------------------------------------------------------------------------------------------------------------------
# results


def check_against_verls_own(verl, batch, estimator: str, variant: str = "verl", function=None) -> None:
    """verl's own estimator, then the routed one (``function`` when given, else the installed variant's), through
    ``compute_advantage``: equal within the two float32 implementations' bounds."""
    expected_advantages, expected_returns = run_compute_advantage(verl, batch, estimator)      # verl's own
    with otb_verl.install(variant) as installation:
        if function is not None:
            assert_route_to(verl, installation, estimator, function)
        advantages, returns = run_compute_advantage(verl, batch, estimator)
    advantage_tolerance, returns_tolerance = two_float32_implementations(batch, ESTIMATORS[estimator])
    advantage_tolerance.assert_close(advantages, expected_advantages, "advantages vs verl's")
    returns_tolerance.assert_close(returns, expected_returns, "returns vs verl's")


@pytest.mark.parametrize("batch_options", list(BATCHES.values()), ids=list(BATCHES))
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_verl_variant_equals_verls_own_estimator(verl, estimator, batch_options):
    drop_in = (otb_torch.compute_optimal_token_baseline_advantage if estimator == "optimal_token_baseline"
               else otb_torch.compute_multi_turn_optimal_token_baseline_advantage)
    check_against_verls_own(verl, trainer_batch(verl, **batch_options), estimator, function=drop_in)


def check_against_the_reference_leave_one_out(verl, batch, estimator: str, function=None) -> None:
    """The routed leave-one-out estimator through ``compute_advantage`` equals the reference's
    ``leave_one_out_token_baseline`` within ``otb_comparison_tolerance``, and differs from verl's own OTB."""
    align = ESTIMATORS[estimator]
    with otb_verl.install("leave_one_out") as installation:
        if function is not None:
            assert_route_to(verl, installation, estimator, function)
        advantages, returns = run_compute_advantage(verl, batch, estimator)
    inputs = inputs_of(batch)
    expected = otb.leave_one_out_token_baseline(**inputs, align=align)
    tolerance = otb_comparison_tolerance(**inputs, align=align, leave_one_out=True, handle_zero_tail=False,
                                         compute_dtype=np.float32)
    tolerance[0].assert_close(advantages, expected.advantages, "advantages vs the reference's leave-one-out")
    tolerance[1].assert_close(returns, expected.returns, "returns vs the reference")
    verl_advantages, _ = run_compute_advantage(verl, batch, estimator)
    assert not np.allclose(advantages, verl_advantages), "the leave-one-out variant changed nothing"


@pytest.mark.parametrize("batch_options", list(BATCHES.values()), ids=list(BATCHES))
@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_leave_one_out_variant_equals_the_reference(verl, estimator, batch_options):
    wrapper = (otb_verl.compute_leave_one_out_token_baseline_advantage if ESTIMATORS[estimator] == "position"
               else otb_verl.compute_multi_turn_leave_one_out_token_baseline_advantage)
    check_against_the_reference_leave_one_out(verl, trainer_batch(verl, **batch_options), estimator, function=wrapper)


def _statistics_from_bf16_logits(verl, batch, seed: int, vocab: int = 4096, scale: float = 8.0) -> None:
    """Σπ² and log π as verl's actor gives them after a bf16 forward: Σπ² by verl's own formula on bf16 logits
    (peaked: ~N(0, 8²)), cast with ``.float()`` as ray_trainer.py:1322 does; log π from the same logits in float32 at
    tokens sampled from them; 0 on padding."""
    mask = batch.batch["response_mask"]
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(*mask.shape, vocab, generator=generator) * scale).to(torch.bfloat16)
    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    tokens = torch.multinomial(log_softmax.reshape(-1, vocab).exp(), 1, generator=generator).reshape(mask.shape)
    valid = mask != 0
    batch.batch["old_log_probs"] = torch.where(valid, log_softmax.gather(-1, tokens[..., None])[..., 0], 0.0)
    batch.batch["sum_pi_squared"] = torch.where(
        valid, verl.torch_functional.calculate_sum_pi_squared_from_logits(logits).float(), 0.0)


_OTHER_VALUE_CHECKS = (
    ("response_mask", 2.0, r"^response_mask: values must be exactly 0 or 1"),
    ("old_log_probs", 0.5, r"^old_log_probs: must be ≤ 0 at valid positions"),
    ("sum_pi_squared", 1.5, r"^sum_pi_squared: must lie in \[0, 1\] at valid positions"),
)


@pytest.mark.parametrize("stride", [1, 37], ids=["contiguous", "strided"])
def test_a_sum_pi_squared_is_rounded_only_if_every_valid_value_survives_the_round_trip(monkeypatch, stride):
    """What counts as rounded to half precision: every value at a valid position survives a round trip, also where a
    value that does not lies outside the sample tried first (then the whole test, in steps, decides); padding does
    not count; NaN does not survive; no valid position, or only 0s and 1s there (nothing to tell), is not rounded."""
    monkeypatch.setattr(otb_verl, "_ROUND_TRIP_CHUNK", 1000)                        # several steps
    monkeypatch.setattr(otb_verl, "_ROUND_TRIP_SAMPLE", 64)                         # every 80th value: column 0
    generator = torch.Generator().manual_seed(3)
    mask = torch.ones(64, 80 * stride)[:, ::stride]
    mask[:, 70:] = 0
    values = torch.rand(64, 80 * stride, generator=generator) * 0.5 + 0.1
    bf16, fp16 = (values.to(half).float()[:, ::stride] for half in (torch.bfloat16, torch.float16))

    def rounded(spp, response_mask=mask):
        return otb_verl._rounded_to_half_precision(dict(sum_pi_squared=spp, response_mask=response_mask))

    assert rounded(bf16) == "bfloat16" and rounded(fp16) == "float16" and rounded(values[:, ::stride]) is None
    sample = max(1, mask.numel() // otb_verl._ROUND_TRIP_SAMPLE)
    for position, expected in (((40, 3), None), ((40, 75), "bfloat16")):         # valid, then padding
        assert (40 * 80 + position[1]) % sample != 0                                 # outside the sample
        one = bf16.clone()
        one[position] = 0.1234567
        assert rounded(one) == expected, position
    nan = bf16.clone()
    nan[40, 3] = float("nan")
    assert rounded(nan) is None
    assert rounded(bf16, torch.zeros_like(mask)) is None
    certain = torch.where(mask > 0, 1.0, 0.25)                                        # a policy sure of every token
    assert rounded(certain) is None and rounded(torch.where(mask > 0, 0.0, 0.5)) is None


@pytest.mark.parametrize("variant", otb_verl.VARIANTS)
@pytest.mark.parametrize("check_values", [True, False])
def test_an_empty_batch_gets_the_documented_error_through_the_installed_route(verl, variant, check_values):
    """B = 0 or T = 0 through verl's registry with otb_torch installed: the shape error naming verl's argument
    (docs/verl.md), whatever the variant and check_values — also where the half-precision test of Σπ² runs first."""
    for shape, message in (((0, 6), r"^token_level_rewards: empty batch"),
                           ((4, 0), r"^token_level_rewards: no positions")):
        empty = torch.zeros(shape)
        index = np.array([f"uid{row // 2}" for row in range(shape[0])], dtype=object)
        with otb_verl.install(variant, check_values=check_values):
            for estimator in ESTIMATORS:
                function = verl.core_algos.get_adv_estimator_fn(estimator)
                with pytest.raises(ValueError, match=message):
                    function(token_level_rewards=empty, response_mask=empty, index=index, old_log_probs=empty,
                             sum_pi_squared=empty)


@pytest.mark.parametrize("estimator", list(ESTIMATORS))
def test_verls_half_precision_sum_pi_squared_passes_the_value_checks(verl, estimator, monkeypatch):
    """verl's actor Σπ² from bf16 logits is tens of percent off on peaked softmaxes, so π² exceeds it far beyond the
    slack of the rule Σπ² ≥ π²; with the default check_values=True the drop-in leaves that rule out for a Σπ² rounded
    to half precision (warning once) and keeps every other check; its results are bitwise those of the unchecked
    path (check_values=False), the one compared with verl's own above. A Σπ² not so rounded is still held to the
    rule."""
    monkeypatch.setattr(otb_verl, "_HALF_PRECISION_WARNED", False)
    batch = trainer_batch(verl, seed=21, multi_turn=ESTIMATORS[estimator] == "valid_token", positions=48)
    _statistics_from_bf16_logits(verl, batch, seed=21)
    own = batch.batch["old_log_probs"].exp() ** 2 - batch.batch["sum_pi_squared"]
    assert float(own.max()) > 0.1, "the batch does not show verl's half-precision error"
    run_compute_advantage(verl, batch, estimator)                          # verl's own runs on it
    with otb_verl.install(check_values=False):
        expected_advantages, expected_returns = run_compute_advantage(verl, batch, estimator)
    with otb_verl.install():
        with pytest.warns(RuntimeWarning, match="sum_pi_squared arrives rounded to bfloat16"):
            advantages, returns = run_compute_advantage(verl, batch, estimator)
        with warnings.catch_warnings():
            warnings.simplefilter("error")                                          # once per process
            run_compute_advantage(verl, batch, estimator)
        bad = copy.deepcopy(batch)
        bad.batch["token_level_rewards"][1, 0] = float("nan")
        with pytest.raises(ValueError, match=r"^token_level_rewards: contains NaN"):   # verl's names
            run_compute_advantage(verl, bad, estimator)
        for key, value, message in _OTHER_VALUE_CHECKS:                           # every other check still runs
            broken = copy.deepcopy(batch)
            row, column = map(int, torch.nonzero(broken.batch["response_mask"])[3])
            broken.batch[key][row, column] = value
            with pytest.raises(ValueError, match=message):
                run_compute_advantage(verl, broken, estimator)
        as_bfloat16 = copy.deepcopy(batch)                                        # a bfloat16 tensor, not cast
        as_bfloat16.batch["sum_pi_squared"] = as_bfloat16.batch["sum_pi_squared"].to(torch.bfloat16)
        run_compute_advantage(verl, as_bfloat16, estimator)
        unrounded = copy.deepcopy(batch)
        unrounded.batch["sum_pi_squared"] += 1e-7 * unrounded.batch["response_mask"]
        with pytest.raises(ValueError, match=r"sum_pi_squared: must be ≥ π²"):
            run_compute_advantage(verl, unrounded, estimator)
    with otb_verl.install("leave_one_out"):
        run_compute_advantage(verl, batch, estimator)
        with pytest.raises(ValueError, match=r"^token_level_rewards: contains NaN"):    # verl's names here too
            run_compute_advantage(verl, bad, estimator)
    assert np.isfinite(advantages).all()
    np.testing.assert_array_equal(advantages, expected_advantages)
    np.testing.assert_array_equal(returns, expected_returns)


def test_installed_options_reach_the_call(verl):
    """check_values is bound into the routed estimator: off, a mask holding 2 passes; on, it is rejected by name."""
    batch = trainer_batch(verl, seed=5)
    batch.batch["response_mask"][0, 0] = 2.0
    with otb_verl.install(check_values=False):
        run_compute_advantage(verl, batch, "optimal_token_baseline")
    with otb_verl.install(check_values=True):
        with pytest.raises(ValueError, match="response_mask: values must be exactly 0 or 1"):
            run_compute_advantage(verl, batch, "optimal_token_baseline")


@pytest.mark.parametrize("variant", otb_verl.VARIANTS)
def test_compute_advantage_passes_verls_inputs_and_our_options(verl, monkeypatch, variant):
    """The routed function receives exactly the keywords of ray_trainer.py:252–275 (config and uid included), with
    install()'s compile and check_values added."""
    seen = []
    real = otb_verl._ESTIMATORS[variant]["tir_optimal_token_baseline"]

    def spy(**kwargs):
        seen.append(kwargs)
        return real(**{**kwargs, "compile": False})         # compiling is slow; that compile=True arrives is the point

    monkeypatch.setitem(otb_verl._ESTIMATORS[variant], "tir_optimal_token_baseline", spy)
    batch = trainer_batch(verl, seed=6, multi_turn=True, is_weights=True)
    with otb_verl.install(variant, compile=True, check_values=False):
        run_compute_advantage(verl, batch, "tir_optimal_token_baseline")
    (kwargs,) = seen
    assert set(kwargs) == {"token_level_rewards", "response_mask", "config", "index", "sum_pi_squared",
                           "old_log_probs", "rollout_is_weights", "compile", "check_values"}
    assert kwargs["compile"] is True and kwargs["check_values"] is False
    assert kwargs["index"].dtype == object and isinstance(kwargs["index"][0], str)
    assert kwargs["config"].adv_estimator == "tir_optimal_token_baseline"
    assert torch.equal(kwargs["rollout_is_weights"], batch.batch["rollout_is_weights"])


@pytest.mark.parametrize("estimator", sorted(ESTIMATORS))
@pytest.mark.parametrize("is_weights", [False, True])
def test_the_verifier_calls_a_target_as_verls_trainer_does(verl, monkeypatch, estimator, is_weights):
    """The verifier's ``verl`` convention passes the keywords verl's own ``compute_advantage`` passes to a registered
    estimator — read off verl here, not written down — every one by keyword, so that a target's parameter order does
    not matter and its own defaults of ``handle_zero_tail`` and ``epsilon`` are what it gets; the two options only in
    cases whose values differ from verl's defaults."""
    from otb_spec.conformance import verify

    kind = {"optimal_token_baseline": "otb", "tir_optimal_token_baseline": "tir-otb"}[estimator]
    real = verl.core_algos.get_adv_estimator_fn(estimator)
    by_verl, by_verifier = [], []

    def spy(calls):
        def estimator_function(*args, **kwargs):
            calls.append((args, kwargs))
            return real(*args, **kwargs)
        return estimator_function

    monkeypatch.setitem(verl.core_algos.ADV_ESTIMATOR_REGISTRY, estimator, spy(by_verl))
    run_compute_advantage(verl, trainer_batch(verl, seed=9, multi_turn=kind == "tir-otb", is_weights=is_weights),
                          estimator)
    ((args, trainer_keywords),) = by_verl
    assert args == () and trainer_keywords["config"] is not None
    verify(spy(by_verifier), kind, layers=("golden",))
    defaults = [keywords for args, keywords in by_verifier
                if (keywords["rollout_is_weights"] is not None) == is_weights and "epsilon" not in keywords]
    others = [keywords for args, keywords in by_verifier if "epsilon" in keywords]
    assert defaults and others and all(args == () for args, _ in by_verifier)
    assert all(list(keywords) == list(trainer_keywords) for keywords in defaults)     # the same names, in verl's order
    assert all(set(keywords) == set(trainer_keywords) | {"handle_zero_tail", "epsilon"} for keywords in others)
    assert all((keywords["handle_zero_tail"], keywords["epsilon"]) != (True, 1e-8) for keywords in others)


# ----------------------------------------------------------------------------------------------------------------------
# Σπ² swap on bf16 logits


def test_sum_pi_squared_swap_on_bf16_logits(verl):
    """What "matches" means for the actor's Σπ² on bf16 logits (N(0, 4²), V = 32768, as a 7B model's):

    * verl's function on bf16 logits computes log-sum-exps rounded to bf16 and is accurate only to ~10 % — it stays
      within the bound of a correct implementation given bf16 logits (``otb_spec.tolerances.sum_pi_squared_tolerance``:
      its log-sum-exps in bf16 are known only to ±u·max|z|) of the exact Σπ² of those logits, and nothing closer can
      be required of it;
    * the swap (ratio S₂/S₁², float32 accumulation, bf16 output) is within its derived bound of the exact value —
      the float32 exp-sum bound plus the bf16 rounding of the output —, its worst error below verl's median error;
    * the swap equals verl's own formula applied to the same logits upcast to float32 within the sum of the two
      derived bounds: both compute the same quantity.
    """
    original = verl.torch_functional.calculate_sum_pi_squared_from_logits
    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(48, 32768, generator=generator) * 4).to(torch.bfloat16)
    exact = otb.sum_pi_squared(logits.double().numpy())            # float64 oracle: Σπ² of the bf16 values themselves
    verl_bf16 = original(logits).double().numpy()
    verl_float32 = original(logits.float()).double().numpy()
    with otb_verl.install(sum_pi_squared=True):
        swapped_function = verl.torch_functional.calculate_sum_pi_squared_from_logits
        assert swapped_function is not original
        swapped = swapped_function(logits)
    assert swapped.dtype == torch.bfloat16 and swapped.shape == (48,)
    swapped = swapped.double().numpy()

    spread = logit_spread(logits.double().numpy())
    ours = logsumexp_tolerance(logits.shape[-1], spread, np.float32) + output_rounding(torch.bfloat16)
    host = logits.double().numpy()
    verl_bf16_bound = sum_pi_squared_tolerance(host, dtype="bfloat16") + output_rounding("bfloat16")
    verl_float32_bound = sum_pi_squared_tolerance(host, dtype="float32") + output_rounding("float32")
    verl_bf16_bound.assert_close(verl_bf16, exact, "verl's Σπ² on bf16 logits vs exact")
    ours.assert_close(swapped, exact, "swapped Σπ² on bf16 logits vs exact")
    (ours + verl_float32_bound).assert_close(swapped, verl_float32, "swapped Σπ² vs verl's formula in float32")
    relative = lambda value: np.abs(value / exact - 1)  # noqa: E731
    assert relative(swapped).max() < np.median(relative(verl_bf16))


# ----------------------------------------------------------------------------------------------------------------------
# install / uninstall


def test_uninstall_restores_every_original_object(verl, monkeypatch):
    core_algos, torch_functional = verl.core_algos, verl.torch_functional
    names = {"optimal_token_baseline": "compute_optimal_token_baseline_advantage",
             "tir_optimal_token_baseline": "compute_multi_turn_optimal_token_baseline_advantage"}
    originals = {name: getattr(core_algos, function) for name, function in names.items()}
    original_sum_pi_squared = torch_functional.calculate_sum_pi_squared_from_logits
    # a verl module that imported the functions by name, under aliases, before install()
    early = types.ModuleType("verl._otb_probe_early")
    early.otb, early.tir, early.spp = (originals["optimal_token_baseline"], originals["tir_optimal_token_baseline"],
                                       original_sum_pi_squared)
    monkeypatch.setitem(sys.modules, early.__name__, early)

    installation = otb_verl.install("leave_one_out", sum_pi_squared=True)
    assert otb_verl.installed() is installation and installation.active
    for name in names:
        assert core_algos.ADV_ESTIMATOR_REGISTRY[name] is installation.estimators[name]
        assert getattr(core_algos, names[name]) is installation.estimators[name]
    assert (early.otb, early.tir) == (installation.estimators["optimal_token_baseline"],
                                      installation.estimators["tir_optimal_token_baseline"])
    assert early.spp is torch_functional.calculate_sum_pi_squared_from_logits is not original_sum_pi_squared
    assert "verl._otb_probe_early.spp" in installation.places
    # a verl module importing by name while installed gets the replacement, and gets verl's back on uninstall
    late = types.ModuleType("verl._otb_probe_late")
    exec("from verl.trainer.ppo.core_algos import compute_optimal_token_baseline_advantage as otb\n"
         "from verl.utils.torch_functional import calculate_sum_pi_squared_from_logits as spp", late.__dict__)
    monkeypatch.setitem(sys.modules, late.__name__, late)
    assert late.otb is installation.estimators["optimal_token_baseline"]

    assert otb_verl.uninstall() is True
    assert otb_verl.installed() is None and not installation.active
    for name, function in names.items():
        assert core_algos.ADV_ESTIMATOR_REGISTRY[name] is originals[name]
        assert getattr(core_algos, function) is originals[name]
        assert verl.core_algos.get_adv_estimator_fn(name) is originals[name]
    assert torch_functional.calculate_sum_pi_squared_from_logits is original_sum_pi_squared
    assert (early.otb, early.tir, early.spp) == (originals["optimal_token_baseline"],
                                                 originals["tir_optimal_token_baseline"], original_sum_pi_squared)
    assert late.otb is originals["optimal_token_baseline"] and late.spp is original_sum_pi_squared
    assert otb_verl.uninstall() is False                                    # nothing left to undo


def test_context_manager_undoes_and_nested_installs_share_one_installation(verl):
    original = verl.core_algos.ADV_ESTIMATOR_REGISTRY["optimal_token_baseline"]
    with otb_verl.install() as installation:
        with pytest.raises(RuntimeError, match=r"already installed .* call otb_torch.verl.uninstall\(\)"):
            otb_verl.install("leave_one_out")
        with otb_verl.install() as inner:                                  # same options: the same installation
            assert inner is installation
        assert otb_verl.installed() is installation and installation.active     # the inner exit undid nothing
        assert verl.core_algos.ADV_ESTIMATOR_REGISTRY["optimal_token_baseline"] is not original
    assert verl.core_algos.ADV_ESTIMATOR_REGISTRY["optimal_token_baseline"] is original
    assert otb_verl.installed() is None


def test_a_plain_install_outlives_a_later_with_block_until_uninstall(verl):
    """A trainer script calls install(); a library it uses wraps its own step in ``with install():`` — leaving that
    block must not undo the script's installation; uninstall() does, at once."""
    original = verl.core_algos.ADV_ESTIMATOR_REGISTRY["optimal_token_baseline"]
    installation = otb_verl.install()
    with otb_verl.install() as inner:
        assert inner is installation
    assert otb_verl.installed() is installation
    assert verl.core_algos.ADV_ESTIMATOR_REGISTRY["optimal_token_baseline"] is installation.estimators[
        "optimal_token_baseline"]
    otb_verl.install()                                                      # a third holder: uninstall() ignores holds
    assert otb_verl.uninstall() is True and not installation.active
    assert verl.core_algos.ADV_ESTIMATOR_REGISTRY["optimal_token_baseline"] is original
    with otb_verl.install() as outer:                                      # a plain install() inside a block holds it
        assert otb_verl.install() is outer
    assert otb_verl.installed() is outer and outer.active
    assert otb_verl.uninstall() is True


def test_install_rejects_bad_options_and_foreign_patches(verl, monkeypatch):
    with pytest.raises(ValueError, match=r"variant: expected one of \('verl', 'leave_one_out'\), got 'loo'"):
        otb_verl.install("loo")
    with pytest.raises(TypeError, match="compile: expected True or False, got 'yes'"):
        otb_verl.install(compile="yes")
    foreign = lambda **kwargs: None  # noqa: E731
    monkeypatch.setitem(verl.core_algos.ADV_ESTIMATOR_REGISTRY, "tir_optimal_token_baseline", foreign)
    with pytest.raises(RuntimeError, match=r"ADV_ESTIMATOR_REGISTRY\['tir_optimal_token_baseline'\] holds .* "
                                           "something else has replaced it"):
        otb_verl.install()
    assert verl.core_algos.ADV_ESTIMATOR_REGISTRY["tir_optimal_token_baseline"] is foreign     # left as found
    assert otb_verl.installed() is None


def test_install_from_environment(verl, monkeypatch):
    monkeypatch.setenv("OTB_VERL_VARIANT", "leave_one_out")
    monkeypatch.setenv("OTB_VERL_SUM_PI_SQUARED", "yes")
    installation = otb_verl.install_from_environment()
    assert installation.options() == {"variant": "leave_one_out", "compile": False, "check_values": True,
                                      "sum_pi_squared": True, "v1_trainer": False}
    otb_verl.uninstall()
    monkeypatch.setenv("OTB_VERL_CHECK_VALUES", "maybe")
    with pytest.raises(ValueError, match="OTB_VERL_CHECK_VALUES: expected one of"):
        otb_verl.install_from_environment()


def test_imports_and_names_the_missing_package():
    """Without verl, ``import otb_torch.verl`` works and ``install()`` says which package is missing (a fresh
    interpreter in which ``import verl`` fails)."""
    program = ("import sys; sys.modules['verl'] = None\n"
               "import otb_torch.verl as v\n"
               "try:\n    v.install()\nexcept ModuleNotFoundError as exc:\n    print(exc)\n")
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ADAPTERS_DIR,
                                                                            os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, env=environment,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "cannot import verl.trainer.ppo.core_algos: the package 'verl' is missing" in result.stdout
    assert "pip install --no-deps verl==0.9.1" in result.stdout


# ----------------------------------------------------------------------------------------------------------------------
# meta-tests: the comparisons above reject wrong estimators


def _mutant_rho_not_squared(*args, rollout_is_weights=None, **kwargs):
    """OTB with ρ instead of ρ² in the energy (passes √ρ where verl squares it)."""
    weights = None if rollout_is_weights is None else rollout_is_weights.sqrt()
    return otb_torch.compute_optimal_token_baseline_advantage(*args, rollout_is_weights=weights, **kwargs)


def _mutant_position_aligned_tir(*args, **kwargs):
    """The multi-turn estimator aligned on positions instead of valid tokens."""
    return otb_torch.compute_optimal_token_baseline_advantage(*args, **kwargs)


def _mutant_without_zero_tail(*args, handle_zero_tail=True, **kwargs):
    """OTB that ignores verl's zero tail (the unique longest member keeps the group baseline beyond L₂)."""
    return otb_torch.compute_optimal_token_baseline_advantage(*args, handle_zero_tail=False, **kwargs)


MUTANTS = {
    "leave-one-out under variant verl": ("optimal_token_baseline", dict(seed=1),
                                         otb_verl.compute_leave_one_out_token_baseline_advantage),
    "ρ instead of ρ²": ("optimal_token_baseline", dict(seed=2, is_weights=True, unequal_groups=True),
                        _mutant_rho_not_squared),
    "multi-turn aligned on positions": ("tir_optimal_token_baseline", dict(seed=3, multi_turn=True),
                                        _mutant_position_aligned_tir),
    "no zero tail": ("optimal_token_baseline", dict(seed=1), _mutant_without_zero_tail),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_comparison_with_verl_rejects_a_wrong_estimator(verl, monkeypatch, mutant):
    estimator, batch_options, wrong = MUTANTS[mutant]
    monkeypatch.setitem(otb_verl._ESTIMATORS["verl"], estimator, wrong)
    with pytest.raises(AssertionError, match="advantages vs verl's"):
        check_against_verls_own(verl, trainer_batch(verl, **batch_options), estimator)


def test_comparison_with_the_reference_rejects_verls_self_inclusive_baseline(verl, monkeypatch):
    monkeypatch.setitem(otb_verl._ESTIMATORS["leave_one_out"], "optimal_token_baseline",
                        otb_torch.compute_optimal_token_baseline_advantage)
    with pytest.raises(AssertionError, match="advantages vs the reference's leave-one-out"):
        check_against_the_reference_leave_one_out(verl, trainer_batch(verl, **BATCHES["single-turn"]),
                                                  "optimal_token_baseline")


# ----------------------------------------------------------------------------------------------------------------------
# the runnable example and the Ray recipe of docs/verl.md


def test_the_verl_example_runs_and_agrees(verl, capsys):
    import importlib.util

    path = os.path.join(os.path.dirname(ADAPTERS_DIR), "examples", "verl_otb_compute_advantage.py")
    spec = importlib.util.spec_from_file_location("verl_otb_compute_advantage", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    results = example.main(["--prompts", "6", "--responses", "4", "--positions", "40", "--repeats", "1"])
    assert "install('leave_one_out')" in capsys.readouterr().out
    batch = example.verl_batch(6, 4, 40)
    inputs = inputs_of(batch)
    for estimator, align in ESTIMATORS.items():
        own, ours, leave_one_out = (results[estimator][key][0] for key in ("own", "verl", "leave_one_out"))
        two_float32_implementations(batch, align)[0].assert_close(ours, own, f"example: {estimator}")
        expected = otb.leave_one_out_token_baseline(**inputs, align=align).advantages
        otb_comparison_tolerance(**inputs, align=align, leave_one_out=True, handle_zero_tail=False,
                                 compute_dtype=np.float32)[0].assert_close(leave_one_out, expected, "example: loo")
    assert otb_verl.installed() is None


@pytest.mark.slow
def test_a_ray_worker_setup_hook_installs_in_every_worker(verl):
    """The recipe of docs/verl.md: ``worker_process_setup_hook`` = ``otb_torch.verl.install_from_environment`` in
    ``ray.init``'s runtime_env reaches every worker process — also actors created with their own runtime_env
    env_vars, as verl's worker groups are (verl/single_controller/ray/base.py:659–665)."""
    ray = pytest.importorskip("ray")
    repository = os.path.dirname(ADAPTERS_DIR)
    ray.init(num_cpus=1, include_dashboard=False, logging_level="ERROR",
             runtime_env={"worker_process_setup_hook": "otb_torch.verl.install_from_environment",
                          "env_vars": {"OTB_VERL_VARIANT": "leave_one_out", "OTB_VERL_SUM_PI_SQUARED": "1",
                                       "PYTHONPATH": os.pathsep.join([ADAPTERS_DIR, repository])}})
    try:
        @ray.remote(num_cpus=0)
        class Probe:
            def routed(self):
                import otb_torch.verl as in_worker
                from verl.trainer.ppo import core_algos

                installation = in_worker.installed()
                return (None if installation is None else installation.options(),
                        core_algos.get_adv_estimator_fn("tir_optimal_token_baseline").__wrapped__.__name__)

        for probe in (Probe.remote(), Probe.options(runtime_env={"env_vars": {"VERL_LIKE": "1"}}).remote()):
            options, routed = ray.get(probe.routed.remote())
            assert options == {"variant": "leave_one_out", "compile": False, "check_values": True,
                               "sum_pi_squared": True, "v1_trainer": False}
            assert routed == "compute_multi_turn_leave_one_out_token_baseline_advantage"
    finally:
        ray.shutdown()


def test_the_documented_command_line_gives_ray_a_valid_runtime_env(verl, monkeypatch):
    """The overrides of docs/verl.md's command line compose with verl 0.9.1's ``ppo_trainer`` config (Hydra), and the
    runtime_env verl passes to ``ray.init`` (its defaults merged with ours, trainer/main_ppo.py:71) is one Ray accepts,
    carrying the setup hook and string env_vars that ``install_from_environment`` reads."""
    hydra = pytest.importorskip("hydra", reason="hydra-core (verl's config system) is not installed")
    ray_runtime_env = pytest.importorskip("ray.runtime_env")
    from omegaconf import OmegaConf
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    text = open(os.path.join(os.path.dirname(ADAPTERS_DIR), "docs", "verl.md"), encoding="utf-8").read()
    command = text.split("python -m verl.trainer.main_ppo", 1)[1].split("...", 1)[0]
    overrides = [word for word in command.replace("\\\n", " ").split() if "=" in word]
    with hydra.initialize_config_module(config_module="verl.trainer.config", version_base=None):
        config = hydra.compose(config_name="ppo_trainer", overrides=overrides)
    assert config.algorithm.adv_estimator == "optimal_token_baseline" and config.trainer.use_v1 is True   # default
    assert config.actor_rollout_ref.actor.calculate_sum_pi_squared is True
    runtime_env = OmegaConf.to_container(OmegaConf.merge(get_ppo_ray_runtime_env(config),
                                                         config.ray_kwargs.ray_init.runtime_env))
    ray_runtime_env.RuntimeEnv(**runtime_env)                       # Ray's own validation (env_vars: Dict[str, str])
    assert runtime_env["worker_process_setup_hook"] == "otb_torch.verl.install_from_environment"
    for name, value in runtime_env["env_vars"].items():
        if name.startswith("OTB_VERL_"):
            monkeypatch.setenv(name, value)
    assert otb_verl.install_from_environment().options() == {
        "variant": "leave_one_out", "compile": False, "check_values": True, "sum_pi_squared": True,
        "v1_trainer": True}
