"""The verifier's fused-token-statistics kind: correct fused kernels are accepted under every convention that offers
it (values and gradients; values only under numpy, and the report says so), a class target is instantiated, a
float64-in-float32 kernel shows exactly the documented deviation, and the command line passes --working-dtype.

Its power against realistic bugs is tested over the mutants (test_conformance_mutants.py) and the realistic ports
(test_realistic_ports.py); verl's own FusedLinearForPPO runs in test_verl_conformance.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

import numpy as np
import pytest

from otb_spec.cli import main
from otb_spec.conformance import (CONVENTIONS, KINDS, TargetError, assert_matches_reference, find_case, golden_cases,
                                  special_cases, verify)

KIND = "fused-token-statistics"
FAST = dict(max_examples=15, shrink_budget=0)


def _run_cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue() + err.getvalue()


def test_the_kind_is_offered_by_the_verl_numpy_and_jax_conventions():
    assert KIND in KINDS
    assert {name for name, convention in CONVENTIONS.items() if KIND in convention.kinds} == {"verl", "numpy", "jax"}


def test_the_reference_is_accepted_values_only_and_the_report_says_so():
    report = verify("otb_spec:token_statistics_from_hidden", KIND, convention="numpy", **FAST)
    assert report.conformant, report.to_text()
    text = report.to_text()
    assert "gradients:   NOT CHECKED" in text
    assert "NOT CHECKED: grad_hidden (no gradients taken), grad_weight (no gradients taken)" in text
    assert report.compared_outputs == ["log_probs", "entropy", "sum_pi_squared"]
    assert {r.layer for r in report.results if r.status == "pass"} == {"signature", "structure", "golden",
                                                                      "generated", "special", "robustness"}


def test_the_torch_port_is_accepted_with_float32s_bound():
    """otb_torch's port computes half-precision inputs' logits in float32: held to float32's working precision
    (stricter than the default, the inputs' dtype), gradients by torch autograd, Σπ² checked."""
    pytest.importorskip("torch")
    report = verify("otb_torch:fused_linear_token_statistics", KIND, working_dtype="float32", **FAST)
    assert report.conformant, report.to_text()
    assert report.compared_outputs == ["log_probs", "entropy", "sum_pi_squared", "grad_hidden", "grad_weight"]
    text = report.to_text()
    assert "working precision = the inputs' dtype or float32, whichever is more precise" in text
    assert any(r.id.endswith("/bfloat16") and r.layer == "special" and r.status == "pass" for r in report.results)


def test_the_jax_port_is_accepted():
    """Structure (float64, float32, bfloat16) and the generated cases, which the jax convention draws in one shape
    (one compilation per dtype); golden and special cases each have a shape of their own and would compile ~20
    programs — the full run (`otb-spec verify otb_jax:fused_linear_token_statistics --kind fused-token-statistics
    --convention jax`) is CONFORMANT too (docs/conformance.md)."""
    pytest.importorskip("jax")
    report = verify("otb_jax:fused_linear_token_statistics", KIND, convention="jax", working_dtype="float32",
                    layers=("signature", "structure", "generated"), max_examples=10, shrink_budget=0)
    assert report.conformant, report.to_text()
    assert "grad_weight" in report.compared_outputs
    assert "jax.vjp" in report.to_text()


def _module_class():
    torch = pytest.importorskip("torch")
    from otb_spec.conformance.mutants import straightforward_fused_token_statistics

    class FusedHead(torch.nn.Module):
        """verl's FusedLinearForPPO layout: a module built with no arguments, called with (hidden_states,
        vocab_weights, input_ids, temperature) and returning (log π, entropy) only."""

        def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
            return straightforward_fused_token_statistics(hidden_states, vocab_weights, input_ids, temperature)[:2]

    return FusedHead


def test_a_module_class_is_instantiated_and_sum_pi_squared_is_optional():
    report = verify(_module_class(), KIND, layers=("signature", "structure", "golden"), **FAST)
    assert report.conformant, report.to_text()
    assert "FusedHead() (verl convention" in report.subject
    assert "NOT CHECKED: sum_pi_squared (not returned by the target)" in report.to_text()
    assert "sum_pi_squared" not in report.compared_outputs


def _float32_always(hidden, weight, token_ids, temperature=1.0):
    """The unfused program with verl's cast: logits formed in the inputs' dtype, then the softmax in float32 whatever
    that dtype — what verl's FusedLinearForPPO does."""
    import realistic_ports

    return realistic_ports._variant(realistic_ports.torch_unfused_token_statistics, "logits_cast_to_float32")(
        hidden, weight, token_ids, temperature=temperature)


def test_float64_computed_in_float32_is_the_documented_deviation_in_every_layer():
    pytest.importorskip("torch")
    report = verify(_float32_always, KIND, **FAST)
    assert report.conformant, report.to_text()
    assert report.verdict == "CONFORMANT WITH 1 DOCUMENTED DEVIATION"
    assert report.observed_deviations == ["fused-float64-in-float32"]
    layers = {r.layer for r in report.deviations}
    assert layers == {"structure", "golden", "generated", "special"}
    assert all(r.id.endswith("float64") for r in report.deviations if r.layer in ("golden", "special"))
    strict = verify(_float32_always, KIND, strict=True, **FAST)
    assert not strict.conformant
    assert {r.id for r in strict.failures} == {r.id for r in report.deviations}


def test_a_wrong_kernel_on_float64_inputs_is_not_excused_by_the_deviation():
    """The deviation's model is the reference judged with float32's bound: a kernel with a real bug still fails on
    float64 cases (all but those where its error happens to stay within float32's bound — a peaked softmax hides a
    flipped entropy term — which are listed as the deviation)."""
    pytest.importorskip("torch")
    from otb_spec.conformance.mutants import MUTANTS

    report = verify(MUTANTS["fused_entropy_wrong_sign"].function, KIND, layers=("golden",), **FAST)
    failed = [r.id for r in report.failures]
    assert not report.conformant and sum(check.endswith("float64") for check in failed) >= 5
    assert len(report.deviations) <= 1


def _temperature_rounded_to_float32(hidden, weight, token_ids, temperature=1.0):
    """A float64 program with one float32 slip: τ held as a float32 scalar (``torch.tensor(temperature)``), so every
    τ ≠ 1 result has float32-sized errors in float64 outputs."""
    import realistic_ports

    return realistic_ports.torch_unfused_token_statistics(hidden, weight, token_ids,
                                                          temperature=float(np.float32(temperature)))


def test_float64_outputs_with_float32_errors_are_a_bug_not_verls_cast():
    """The deviation excuses verl's cast, which shows in its outputs (log π returned as float32); a port returning
    float64 whose values are only float32-accurate has a bug of the same size but another cause, and fails."""
    pytest.importorskip("torch")
    report = verify(_temperature_rounded_to_float32, KIND, layers=("structure", "golden"), **FAST)
    assert not report.conformant and report.observed_deviations == []
    failed = {r.id for r in report.failures}
    assert any("tau-0-7" in check and check.endswith("float64") for check in failed), failed


def test_cases_and_the_assertion_helper():
    """Golden, special and robustness cases carry the reference and per-output bounds; assert_matches_reference
    takes any subset of the optional outputs."""
    case = find_case(KIND, "ordinary hidden states (N = 7, H = 16, V = 50), τ = 0.7", "float32")
    expected = case.expected()
    assert set(expected) == {"log_probs", "entropy", "sum_pi_squared", "grad_hidden", "grad_weight"}
    assert expected["grad_weight"].shape == case.weight.shape and case.output_shape("grad_hidden") == (7, 16)
    assert_matches_reference(case, log_probs=expected["log_probs"].astype(np.float32),
                             entropy=expected["entropy"].astype(np.float32))
    with pytest.raises(AssertionError, match="entropy"):
        assert_matches_reference(case, log_probs=expected["log_probs"], entropy=-expected["entropy"])
    assert {c.dtype for c in special_cases(KIND)} == {"float64", "float32", "bfloat16", "float16"}
    assert all(np.all(np.abs(c.log_probs_cotangent * 64) % 1 == 0) for c in golden_cases(KIND))


def test_the_command_line_takes_the_kind_and_the_working_dtype(tmp_path):
    path = tmp_path / "report.json"
    status, out = _run_cli("verify", "otb_spec:token_statistics_from_hidden", "--kind", KIND, "--convention",
                           "numpy", "--layer", "golden", "--working-dtype", "float32", "--no-progress", "--json",
                           str(path))
    assert status == 0 and out.startswith("CONFORMANT"), out
    data = json.loads(path.read_text())
    assert data["compared_outputs"] == ["log_probs", "entropy", "sum_pi_squared"]
    assert any("whichever is more precise" in note for note in data["notes"])
    status, out = _run_cli("verify", "otb_spec:optimal_token_baseline", "--kind", "otb", "--convention", "numpy",
                           "--working-dtype", "bfloat16")
    assert status == 2 and "working_dtype: float32 or float64 for the OTB kinds" in out
    with pytest.raises(TargetError, match="working_dtype: expected"):
        verify("otb_spec:token_statistics_from_hidden", KIND, convention="numpy", working_dtype="int8")


def test_the_working_dtype_decides_the_bound_of_half_precision_inputs():
    """A kernel that forms its logits in the inputs' dtype (verl's) passes the half-precision special cases with the
    default bound (working precision = the inputs' dtype) and fails them when held to float32's."""
    pytest.importorskip("torch")
    default = verify(_float32_always, KIND, layers=("special",), **FAST)
    assert default.conformant, default.to_text()
    strict_bound = verify(_float32_always, KIND, layers=("special",), working_dtype="float32", **FAST)
    failed = {r.id.rsplit("/", 1)[-1] for r in strict_bound.failures}
    assert failed and failed <= {"bfloat16", "float16"}, strict_bound.to_text()


def _halved_entropy_under_reentrant_checkpoint(hidden, weight, token_ids, temperature=1.0):
    """A wrong kernel (the entropy halved) whose graph refuses torch.autograd.grad: a reentrant checkpoint."""
    torch = pytest.importorskip("torch")
    from torch.utils.checkpoint import checkpoint

    def statistics(h, w):
        log_p = torch.log_softmax(h.to(torch.float32) @ w.to(torch.float32).T / temperature, dim=-1)
        chosen = log_p.gather(-1, token_ids.unsqueeze(-1)).squeeze(-1)
        return chosen.to(h.dtype), (-0.5 * (log_p.exp() * log_p).sum(-1)).to(h.dtype)

    return checkpoint(statistics, hidden, weight, use_reentrant=True)


def test_a_reentrant_checkpoint_ports_snippet_reproduces_its_failure():
    """The snippet forms the gradients as the verifier did for this graph (backward(), read from .grad): run as
    printed, it gives the report's largest entropy error instead of torch.autograd.grad's refusal."""
    pytest.importorskip("torch")
    report = verify(_halved_entropy_under_reentrant_checkpoint, KIND, convention="verl", layers=("golden",), **FAST)
    failure = next(r for r in report.failures if r.snippet)
    entropy = next(c for c in failure.comparisons if c.output == "entropy")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(re.sub(r"^from \S+ import \S+ as target$", "target = port", failure.snippet, flags=re.M),
             {"port": _halved_entropy_under_reentrant_checkpoint})
    reproduced = float(re.search(r"entropy ([0-9.e+-]+)", printed.getvalue()).group(1))
    assert reproduced == pytest.approx(entropy.max_abs_error, rel=1e-6)
