"""verl 0.9.1 itself — the first third-party implementation — through the verifier, out of the box (issue 11).

Its three advantage and Σπ² functions and its fused kernel ``FusedLinearForPPO`` (issue 23: log π and entropy from
hidden states and the LM head, values and gradients; nobody tested that path before) are CONFORMANT WITH N DOCUMENTED
DEVIATIONS: every difference from the reference is one of the documented deviations (ε = 0: 0/0 = NaN by definition;
half-precision lengths and the fused kernel's float64-in-float32 cast, known verl defects), listed in the report; with
``strict=True`` they fail on exactly those checks. Needs the ``verl`` test extra (the README's test command installs
it); skipped with the reason otherwise.
"""

from __future__ import annotations

import pytest

from otb_spec.conformance import verify

pytest.importorskip("torch")
core_algos = pytest.importorskip("verl.trainer.ppo.core_algos", reason="needs verl 0.9.1 (the `verl` test extra)")

TARGETS = {
    "otb": ("verl.trainer.ppo.core_algos:compute_optimal_token_baseline_advantage", {"epsilon-zero-nan"}),
    "tir-otb": ("verl.trainer.ppo.core_algos:compute_multi_turn_optimal_token_baseline_advantage",
                {"epsilon-zero-nan"}),
    "sum-pi-squared": ("verl.utils.torch_functional:calculate_sum_pi_squared_from_logits", set()),
    "fused-token-statistics": ("verl.utils.experimental.torch_functional:FusedLinearForPPO",
                               {"fused-float64-in-float32"}),
}
STRICT_LAYERS = ("structure", "golden", "special")


@pytest.fixture(scope="module", params=sorted(TARGETS))
def verl_reports(request):
    kind = request.param
    target, expected = TARGETS[kind]
    if kind == "fused-token-statistics":       # verl's own class, not otb_torch.verl.install's subclass of it
        from verl.utils.experimental import torch_functional

        assert torch_functional.FusedLinearForPPO.__name__ == "FusedLinearForPPO", \
            "otb_torch.verl.install(sum_pi_squared=True) is in effect: this would check the port, not verl"
    report = verify(target, kind, max_examples=30)
    strict = verify(target, kind, layers=STRICT_LAYERS, strict=True)
    return kind, expected, report, strict


def test_verl_passes_out_of_the_box_with_its_deviations_listed(verl_reports):
    kind, expected, report, _ = verl_reports
    text = report.to_text()
    assert report.conformant and report.exit_status == 0, text
    assert set(report.observed_deviations) == expected
    first = text.splitlines()[0]
    plural = "S" if len(expected) > 1 else ""
    assert first == (f"CONFORMANT WITH {len(expected)} DOCUMENTED DEVIATION{plural}" if expected else "CONFORMANT")
    for deviation in expected:
        assert f"{deviation} [" in text and "observed in" in text
    if kind in ("otb", "tir-otb"):   # the trainer's int64 mask: verl's lengths are exact, its bfloat16 cases pass
        assert any(r.layer == "special" and r.id.endswith("bfloat16") and r.status == "pass" for r in report.results)
    if kind == "fused-token-statistics":
        # log π and entropy, values and gradients, in float32, bfloat16 and float16 agree with the reference; the
        # deviation is confined to float64 inputs; verl returns no Σπ², and the report says it was not checked
        assert all(r.id.endswith("float64") for r in report.deviations if r.layer in ("golden", "special"))
        assert report.compared_outputs == ["log_probs", "entropy", "grad_hidden", "grad_weight"]
        assert "NOT CHECKED: sum_pi_squared (not returned by the target)" in text
        assert any(r.layer == "special" and r.id.endswith("bfloat16") and r.status == "pass" for r in report.results)


def test_strict_fails_verl_on_exactly_its_deviations(verl_reports):
    kind, expected, report, strict = verl_reports
    deviating = {r.id for r in report.deviations if r.layer in STRICT_LAYERS}
    assert {r.id for r in strict.failures} == deviating
    assert strict.conformant == (not expected)
    assert all(r.deviation in expected for r in strict.failures)


@pytest.mark.parametrize("kind", ["otb", "tir-otb"])
def test_verls_half_precision_arithmetic_is_not_a_float32_program(kind):
    """verl forms w, W and the returns in the inputs' dtype: conformant by default (the bfloat16 bound admits it —
    on the T = 4096 bfloat16 case its multi-turn OTB flips the sign of about a quarter of the valid advantages), but
    not when declared as a program computing in float32, which --working-dtype float32 holds half-precision cases
    to (docs/conformance.md, "What a verdict on half-precision inputs says")."""
    target = TARGETS[kind][0]
    declared = verify(target, kind, layers=("special",), working_dtype="float32")
    failed = {r.id for r in declared.failures}
    assert failed and all("bfloat16" in check or "float16" in check for check in failed), failed
    assert any(r.id.endswith("float32") and r.status == "pass" for r in declared.results)
    # declared float64: held to float64's bound everywhere — never more lenient than float32
    failed64 = {r.id for r in verify(target, kind, layers=("special",), working_dtype="float64").failures}
    assert failed <= failed64 and any(check.endswith("float32") for check in failed64), failed64


class _VerlBehindTheAdapterProtocol:
    """verl's single-turn OTB as an adapter that declares float32 sums for half-precision inputs — as a port would
    that keeps verl's arithmetic (w, W and the returns in the inputs' dtype) behind ``compute_dtype``."""

    name, device = "verl-behind-the-adapter-protocol", "cpu"

    def asarray(self, array, dtype):
        import numpy as np
        import torch

        return torch.tensor(np.asarray(array, dtype=np.float64)).to(getattr(torch, dtype))

    def to_numpy(self, array):
        import torch

        array = array.detach()
        return (array.float() if array.dtype in (torch.bfloat16, torch.float16) else array).numpy()

    def segments(self, group_ids):
        return group_ids

    def compute_dtype(self, input_dtype):
        return "float64" if input_dtype == "float64" else "float32"

    def optimal_token_baseline(self, rewards, response_mask, segments, log_probs, sum_pi_squared, *, is_weights=None,
                               handle_zero_tail=True, epsilon=1e-8):
        return core_algos.compute_optimal_token_baseline_advantage(
            token_level_rewards=rewards, response_mask=response_mask, index=segments, old_log_probs=log_probs,
            sum_pi_squared=sum_pi_squared, rollout_is_weights=is_weights, handle_zero_tail=handle_zero_tail,
            epsilon=epsilon)


def test_verls_half_precision_lengths_show_only_with_a_half_precision_mask():
    """verl's trainer holds response_mask as int64 (its agent loop; compute_response_mask slices the attention mask),
    so verl's lengths are exact there and its reports above (the trainer's call) observe no half-precision-lengths.
    Given the mask in bfloat16 — as the adapter protocol passes every input in the case's dtype — verl rounds lengths
    above 256, and the verifier recognises the documented deviation on the long bfloat16 case only."""
    from otb_spec.conformance import verify_adapter

    report = verify_adapter(_VerlBehindTheAdapterProtocol(), kinds=("otb",), layers=("special",))
    assert report.conformant and report.observed_deviations == ["half-precision-lengths"], report.to_text()
    assert {r.id for r in report.deviations} == {"otb/special/long-sequences-as-bfloat16-inputs/bfloat16"}


def test_a_port_rounding_its_lengths_is_not_excused_where_the_trainer_gives_an_int64_mask():
    """Under the verl convention the mask is int64, as in verl's trainer, where verl's lengths are exact: a port that
    casts the mask to the rewards' dtype before counting (verl's function behind such a cast) rounds its lengths where
    verl does not, and half-precision-lengths does not excuse it."""

    def casts_the_mask(token_level_rewards, response_mask, **kwargs):
        return core_algos.compute_optimal_token_baseline_advantage(
            token_level_rewards=token_level_rewards, response_mask=response_mask.to(token_level_rewards.dtype),
            **kwargs)

    report = verify(casts_the_mask, "otb", layers=("special",))
    assert not report.conformant and not report.observed_deviations, report.to_text()
    assert {r.id for r in report.failures} == {"otb/special/long-sequences-as-bfloat16-inputs/bfloat16"}


def test_an_adapter_is_held_to_float32_arithmetic_when_it_says_so():
    """verify_adapter(working_dtype="float32") — `otb-spec verify --adapter NAME --working-dtype float32` — holds
    half-precision inputs to float32's bound: verl's half-precision arithmetic behind the adapter protocol conforms by
    default (the bfloat16 bound must admit verl) and fails with it, on bfloat16 checks only; the port's own adapter,
    which widens first, conforms either way."""
    from otb_spec.conformance import TargetError, verify_adapter

    port = _VerlBehindTheAdapterProtocol()
    default = verify_adapter(port, kinds=("otb",), layers=("special",))
    assert default.conformant, default.to_text()
    declared = verify_adapter(port, kinds=("otb",), layers=("special",), working_dtype="float32")
    failed = {result.id for result in declared.failures}
    assert failed and all("bfloat16" in check for check in failed), failed
    assert any("working_dtype='float32'" in note for note in declared.notes)
    widening = verify_adapter("torch-cpu", kinds=("otb", "tir-loo-otb", "sum-pi-squared"), layers=("special",),
                              working_dtype="float32")
    assert widening.conformant, widening.to_text()
    with pytest.raises(TargetError, match="working_dtype: float32 or float64 for an adapter"):
        verify_adapter(port, kinds=("otb",), working_dtype="bfloat16")
