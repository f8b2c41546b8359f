"""The conformance verifier: accepts correct implementations under every convention, rejects wrong ones with a useful
report, and behaves as a command-line tool should (exit statuses, JSON, skip files, seeds).

The verifier's power against realistic bugs is tested separately, over the mutants (test_conformance_mutants.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import subprocess
import sys

import numpy as np
import pytest

import otb_spec
from otb_spec.cli import main
from otb_spec.conformance import (CONVENTIONS, KINDS, LAYERS, Case, Outcome, Subject, TargetError,
                                  assert_matches_reference, compare, find_case, generated_cases, golden_cases,
                                  load_target, read_skip_file, special_cases, verify, verify_adapter)
from otb_spec.conformance._checks import run_checks
from otb_spec.conformance._subjects import _numpy_dtype

FAST = dict(max_examples=20)


def _run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(list(argv))
    return status, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------------------------------------------------
# correct implementations conform


@pytest.mark.parametrize("target, kind", [
    ("otb_spec:optimal_token_baseline", "otb"),
    ("otb_spec:multi_turn_optimal_token_baseline", "tir-otb"),
    ("otb_spec:leave_one_out_token_baseline", "loo-otb"),
    ("otb_spec:leave_one_out_token_baseline", "tir-loo-otb"),
    ("otb_spec:sum_pi_squared", "sum-pi-squared"),
])
def test_reference_conforms_under_the_numpy_convention(target, kind):
    report = verify(target, kind, convention="numpy", **FAST)
    assert report.conformant, report.to_text()
    assert report.exit_status == 0
    layers = {result.layer for result in report.results if result.status == "pass"}
    assert layers == set(LAYERS) - ({"robustness"} if kind == "sum-pi-squared" else set())   # logits have no mask


@pytest.mark.parametrize("target, kind", [
    ("otb_torch:compute_optimal_token_baseline_advantage", "otb"),
    ("otb_torch:compute_multi_turn_optimal_token_baseline_advantage", "tir-otb"),
    ("otb_torch:calculate_sum_pi_squared_from_logits", "sum-pi-squared"),
])
def test_torch_drop_ins_conform_under_the_verl_convention(target, kind):
    pytest.importorskip("torch")
    report = verify(target, kind, **FAST)
    assert report.conformant, report.to_text()
    # bfloat16 special cases ran (the drop-ins accumulate in float32)
    assert any(r.layer == "special" and r.id.endswith("bfloat16") and r.status == "pass" for r in report.results)


# JAX goes through the verifier in test_jax_convention_checks_otb_jax_functions (and through the shared suite in
# tests/test_adapters.py); verifying the jax-cpu adapter here as well cost 36 s of CI time for no new path.
@pytest.mark.parametrize("name, examples", [("numpy-reference", 20), ("torch-cpu", 20)])
def test_adapters_conform(name, examples):
    from otb_spec.adapters import _REGISTRY

    if not _REGISTRY[name].runnable():
        pytest.skip(f"{name}: framework not installed")
    report = verify_adapter(name, max_examples=examples)
    assert report.conformant, report.to_text()
    assert set(report.kinds) == set(KINDS) - {"fused-token-statistics"}    # the protocol has no fused-kernel method


def _grouped_reference(kind):
    function = {"otb": otb_spec.optimal_token_baseline, "tir-otb": otb_spec.multi_turn_optimal_token_baseline,
                "loo-otb": otb_spec.leave_one_out_token_baseline,
                "tir-loo-otb": otb_spec.leave_one_out_token_baseline}[kind]

    def grouped(rewards, response_mask, log_probs, sum_pi_squared, *, is_weights=None, epsilon=1e-8, **options):
        groups, size, positions = rewards.shape
        flat = lambda a: None if a is None else a.reshape(groups * size, positions)  # noqa: E731
        result = function(flat(rewards), flat(response_mask), np.repeat(np.arange(groups), size), flat(log_probs),
                          flat(sum_pi_squared), is_weights=flat(is_weights), epsilon=epsilon, **options)
        return result.advantages.reshape(rewards.shape), result.returns.reshape(rewards.shape)

    return grouped


@pytest.mark.parametrize("kind", ["otb", "tir-otb", "loo-otb", "tir-loo-otb"])
def test_grouped_convention_checks_a_port_with_a_group_layout(kind):
    report = verify(_grouped_reference(kind), kind, convention="grouped", **FAST)
    assert report.conformant, report.to_text()
    skipped = [r for r in report.results if r.status == "skip"]
    # golden cases with no [G, N, T] layout; and, without ml_dtypes (it comes with JAX), the bfloat16 cases: NumPy
    # has no bfloat16 of its own to hand over
    bfloat16_deliverable = _numpy_dtype("bfloat16") is not None
    assert any("unequal sizes" in r.message for r in skipped)
    assert all("unequal sizes" in r.message or (not bfloat16_deliverable and r.id.endswith("/bfloat16")
                                                and "cannot deliver bfloat16" in r.message) for r in skipped)


def test_jax_convention_checks_otb_jax_functions():
    otb_jax = pytest.importorskip("otb_jax")
    report = verify(otb_jax.optimal_token_baseline, "otb", convention="jax",   # each shape compiles: golden only
                    layers=("signature", "structure", "golden"))
    assert report.conformant, report.to_text()


def test_every_convention_is_described_and_offers_kinds():
    assert {"verl", "numpy", "grouped", "jax"} <= set(CONVENTIONS)
    for convention in CONVENTIONS.values():
        assert convention.description and set(convention.kinds) <= set(KINDS)


# ----------------------------------------------------------------------------------------------------------------------
# wrong implementations are rejected with a useful report


def _wrong_returns(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
                   handle_zero_tail=True, epsilon=1e-8):
    result = otb_spec.optimal_token_baseline(rewards, response_mask, group_ids, log_probs, sum_pi_squared,
                                             is_weights=is_weights, handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    return result.advantages, result.returns * np.asarray(response_mask)        # verl returns G unmasked


@pytest.fixture(scope="module")
def wrong_report():
    return verify(_wrong_returns, "otb", convention="numpy", **FAST)


def test_failure_report_has_case_errors_tolerance_and_a_snippet_that_reproduces_it(wrong_report):
    report = wrong_report
    assert not report.conformant and report.exit_status == 1
    failure = next(r for r in report.failures if r.layer == "generated")
    returns = next(c for c in failure.comparisons if c.output == "returns")
    assert returns.violations > 0 and returns.max_abs_error > 0
    assert returns.worst_got != returns.worst_expected and "error bound" in returns.tolerance_reason
    text = report.to_text()
    for needle in ("FAIL otb/generated/", "shrunk by Hypothesis", "reproduce:", "max abs error", "tolerance:",
                   "RESULT: NOT CONFORMANT"):
        assert needle in text
    # the snippet is a program: it prints the same largest error
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(re.sub(r"^from \S+ import _wrong_returns as target$", "target = _wrong_returns", failure.snippet,
                    flags=re.M), {"_wrong_returns": _wrong_returns})
    numbers = [float(x) for x in re.findall(r"returns ([0-9.e+-]+)", printed.getvalue())]
    assert numbers and numbers[0] == pytest.approx(returns.max_abs_error, rel=1e-12)


def test_json_report_holds_the_same_findings(tmp_path, wrong_report):
    report = wrong_report
    path = tmp_path / "report.json"
    report.write_json(str(path))
    data = json.loads(path.read_text())
    assert data["schema"] == "otb-spec-verify-report" and data["schema_version"] == 2
    assert data["verdict"] == "NOT CONFORMANT" == report.to_text().splitlines()[0]
    assert data["conformant"] is False and data["exit_status"] == 1
    assert len(data["checks"]) == len(report.results)
    failed = [c for c in data["checks"] if c["status"] == "fail"]
    assert failed and all(c["snippet"] for c in failed if c["layer"] != "structure")
    assert data["summary"]["otb/generated"]["fail"] >= 1


def test_failing_generated_cases_are_shrunk(wrong_report):
    unshrunk = verify(_wrong_returns, "otb", convention="numpy", layers=("generated",), shrink_budget=0, **FAST)
    shrunk = [r for r in wrong_report.results if r.layer == "generated"]
    assert len(unshrunk.failures) == len(shrunk) == 3
    for before, after in zip(unshrunk.failures, shrunk):
        assert "not shrunk" in before.message and "shrunk by Hypothesis" in after.message
        size = lambda result: int(re.search(r"B=(\d+), T=(\d+)", result.case).group(1)) * int(  # noqa: E731
            re.search(r"T=(\d+)", result.case).group(1))
        assert size(after) <= size(before)


def test_the_same_seed_replays_the_same_cases():
    options = dict(convention="numpy", layers=("generated",), seed=7, max_examples=10, shrink_budget=20)
    first, second = verify(_wrong_returns, "otb", **options), verify(_wrong_returns, "otb", **options)
    assert [(r.id, r.case, r.snippet) for r in first.results] == [(r.id, r.case, r.snippet) for r in second.results]


def test_signature_failure_stops_the_run():
    report = verify(lambda logits: logits, "otb", convention="numpy")
    assert [r.id for r in report.results] == ["otb/signature"]
    assert report.results[0].status == "fail" and "cannot be called" in report.results[0].message
    assert report.exit_status == 1


def test_exceptions_of_the_implementation_are_findings_not_crashes():
    def crashes(*args, **kwargs):
        raise RuntimeError("boom")

    report = verify(crashes, "otb", convention="numpy", **FAST)
    assert not report.conformant
    assert all("raised RuntimeError: boom" in r.message for r in report.failures if r.layer != "signature")


def test_structure_layer_catches_nondeterminism_mutation_and_dtype():
    rng = np.random.default_rng(0)

    def noisy(rewards, response_mask, group_ids, log_probs, sum_pi_squared, **options):
        advantages, returns = _wrong_returns(rewards, response_mask, group_ids, log_probs, sum_pi_squared, **options)
        log_probs *= 1.0                                                       # in place, same values: not a change
        rewards[...] = rewards + 1.0                                           # in place, changed
        return advantages + rng.normal(size=advantages.shape) * 1e-3, returns.astype(np.float16)

    failed = {r.id for r in verify(noisy, "otb", convention="numpy", layers=("structure",)).failures}
    assert {"otb/structure/deterministic", "otb/structure/inputs-unchanged", "otb/structure/dtypes"} <= failed
    assert "otb/structure/shapes" not in failed


def test_structure_layer_catches_outputs_on_another_device():
    case_run = Subject("fake", KINDS, "cpu", lambda case: Outcome(
        dict(zip(("advantages", "returns"), otb_spec.optimal_token_baseline(
            case.rewards, case.response_mask, case.group_ids, case.log_probs, case.sum_pi_squared)[:2])),
        {"advantages": case.dtype, "returns": case.dtype}, {"cuda:0"}, {"cpu"}), lambda case: "")
    results = {r.id: r for r in run_checks(case_run, "otb", layers=("structure",))}
    assert results["otb/structure/devices"].status == "fail"
    assert "cuda:0" in results["otb/structure/devices"].message


def test_otb_spec_definitions_beyond_verl_carry_a_note():
    noted = [case for case in golden_cases("otb", ("float64",)) if case.note]
    assert noted and all(case.epsilon == 0.0 and "verl" in case.note for case in noted)


# ----------------------------------------------------------------------------------------------------------------------
# comparison rule


def test_compare_rejects_nan_inf_and_wrong_shapes_and_leaves_ill_conditioned_elements_unchecked():
    case = golden_cases("otb", ("float32",))[1]
    expected = case.expected()
    good = compare(case, dict(expected))
    assert all(c.ok for c in good)
    broken = dict(expected, advantages=np.where(np.arange(expected["advantages"].size).reshape(
        expected["advantages"].shape) == 3, np.nan, expected["advantages"]))
    assert not compare(case, broken)[0].ok
    infinite = dict(expected, returns=expected["returns"] + np.inf)
    assert compare(case, infinite)[1].violations == expected["returns"].size
    assert compare(case, dict(expected, returns=expected["returns"][:, :-1]))[1].shape_problem
    assert compare(case, {"advantages": expected["advantages"]})[1].shape_problem == "missing from the outputs"
    zero_energy = next(c for c in golden_cases("otb", ("float32",)) if c.name.startswith("deterministic"))
    assert all(c.ok for c in compare(zero_energy, zero_energy.expected()))


def test_assert_matches_reference_accepts_torch_tensors_and_reports_the_worst_element():
    torch = pytest.importorskip("torch")
    case = golden_cases("otb", ("float32",))[2]
    advantages = torch.tensor(case.expected()["advantages"], dtype=torch.float32)
    returns = torch.tensor(case.expected()["returns"], dtype=torch.float32)
    assert_matches_reference(case, advantages=advantages, returns=returns)
    with pytest.raises(AssertionError, match="worst at"):
        assert_matches_reference(case, advantages=advantages + 1e-3, returns=returns)


def test_sum_pi_squared_tolerance_is_per_row():
    """Each row's bound grows with its own largest |z| (a log-sum-exp of logits near ±1e4 is known only to ±ε·1e4):
    the rows near ±1e4 get a wide bound, the row near 0 keeps a tight one."""
    case = golden_cases("sum-pi-squared", ("float32",))[2]              # rows near +1e4, −1e4 and 0
    rtol = np.asarray(case.tolerances()["sum_pi_squared"].rtol)
    assert rtol.shape == case.logits.shape[:-1]
    eps = 2.0**-23
    assert rtol[2] < 8 * eps * (case.logits.shape[-1] + 100) * 2
    assert rtol[0] > 8 * eps * 1e4 and rtol[1] > 8 * eps * 1e4


def test_cases_are_private_read_only_copies():
    rewards = np.zeros((2, 3))
    case = Case("otb", "copy", "float64", rewards, np.ones((2, 3)), np.array(["a", "a"]), np.full((2, 3), -1.0),
                np.full((2, 3), 0.5))
    rewards[0, 0] = 5.0
    assert case.rewards[0, 0] == 0.0
    with pytest.raises(ValueError):
        case.rewards[0, 0] = 1.0
    assert case.group_ids.dtype == object


def test_find_case_finds_golden_and_special_cases():
    assert find_case("otb", golden_cases("otb")[0].name, "float32").dtype == "float32"
    special = special_cases("tir-otb")[1]
    assert find_case("tir-otb", special.name, special.dtype).rewards.shape == (16, 4096)
    with pytest.raises(ValueError, match="name"):
        find_case("otb", "no such case", "float32")


# ----------------------------------------------------------------------------------------------------------------------
# targets, skip files, command line


def test_load_target_from_module_and_file(tmp_path):
    assert load_target("otb_spec:optimal_token_baseline") is otb_spec.optimal_token_baseline
    assert load_target("otb_spec.adapters:ReferenceAdapter.sum_pi_squared")
    source = tmp_path / "my_otb.py"
    source.write_text("def f(*args, **kwargs):\n    return 1\n")
    assert load_target(f"{source}:f")() == 1
    for spec, message in [("no_colon", "expected 'package.module:callable'"), ("no_such_module_xyz:f", "cannot import"),
                          ("otb_spec:no_such_function", "no attribute"), ("otb_spec:__version__", "not a callable"),
                          (f"{tmp_path}/missing.py:f", "no file")]:
        with pytest.raises(TargetError, match=message):
            load_target(spec)


def test_snippets_import_the_target_the_way_it_was_named():
    from otb_spec.conformance._subjects import _import_line

    assert _import_line("pkg.mod:fn") == "from pkg.mod import fn as target"
    assert _import_line("pkg.mod:Class.method") == "from pkg.mod import Class as target; target = target.method"
    assert "spec_from_file_location('target', 'dir/my_otb.py')" in _import_line("dir/my_otb.py:fn")
    assert _import_line("tests.x:outer.<locals>.fn").startswith("target = ...  # bind `target`")


def test_skip_file_skips_matching_checks_and_requires_reasons(tmp_path):
    skip = tmp_path / "skips.txt"
    skip.write_text("# verl gives NaN where otb-spec defines 0\n"
                    "otb/golden/*defined-as-baseline-0*  # we reproduce verl exactly\n"
                    "otb/special/*  # too slow for our CI\n")
    entries = read_skip_file(str(skip))
    assert entries == [("otb/golden/*defined-as-baseline-0*", "we reproduce verl exactly"),
                       ("otb/special/*", "too slow for our CI")]
    report = verify("otb_spec:optimal_token_baseline", "otb", convention="numpy", skips=entries, **FAST)
    skipped = [r for r in report.results if r.status == "skip"]
    assert len(skipped) == 2 * 2 + len(special_cases("otb")) and all(r.message.startswith("skipped: ") for r in skipped)
    assert report.conformant
    (tmp_path / "bad.txt").write_text("otb/special/*\n")
    with pytest.raises(ValueError, match="needs a reason"):
        read_skip_file(str(tmp_path / "bad.txt"))


def test_cli_verify_exit_status_zero_for_a_conformant_target():
    status, out, _ = _run_cli("verify", "otb_spec:optimal_token_baseline", "--kind", "otb", "--convention", "numpy",
                              "--max-examples", "10")
    assert status == 0 and "RESULT: CONFORMANT" in out and "target:      otb_spec:optimal_token_baseline" in out


def test_cli_verify_exit_status_one_and_json_for_a_wrong_target(tmp_path):
    pytest.importorskip("torch")
    path = tmp_path / "report.json"
    status, out, _ = _run_cli("verify", "otb_spec.conformance.mutants:rho_not_squared", "--kind", "otb",
                              "--max-examples", "10", "--json", str(path), "--layer", "golden")
    assert status == 1 and "RESULT: NOT CONFORMANT" in out and "reproduce:" in out
    assert json.loads(path.read_text())["exit_status"] == 1


@pytest.mark.parametrize("argv, message", [
    (["verify", "no_such_module_xyz:f", "--kind", "otb"], "cannot import"),
    (["verify", "otb_spec:optimal_token_baseline"], "--kind"),
    (["verify", "otb_spec:optimal_token_baseline", "--kind", "loo-otb"], "verl convention has no 'loo-otb'"),
    (["verify", "otb_spec:optimal_token_baseline", "--kind", "otb", "--convention", "nope"], "convention"),
    (["verify", "otb_spec:optimal_token_baseline", "--kind", "otb", "--adapter", "torch-cpu"], "either TARGET"),
    (["verify", "--adapter", "no-such-adapter"], "unknown adapter"),
    (["verify", "otb_spec:optimal_token_baseline", "--kind", "otb", "--max-examples", "0"], "--max-examples"),
])
def test_cli_verify_exit_status_two_for_usage_and_import_errors(argv, message):
    status, _, err = _run_cli(*argv)
    assert status == 2 and message in err


def test_cli_verify_cuda_without_a_gpu_is_a_usage_error():
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    status, _, err = _run_cli("verify", "otb_torch:compute_optimal_token_baseline_advantage", "--kind", "otb",
                              "--device", "cuda")
    assert status == 2 and "no CUDA device" in err


def test_cli_verify_adapter_and_list():
    pytest.importorskip("torch")
    status, out, _ = _run_cli("verify", "--adapter", "torch-cpu", "--kind", "otb", "--kind", "sum-pi-squared",
                              "--max-examples", "10")
    assert status == 0 and "otb/golden" in out and "sum-pi-squared/special" in out and "tir-otb" not in out
    status, out, _ = _run_cli("verify", "--list")
    assert status == 0 and all(name in out for name in CONVENTIONS)
    described = re.findall(r"^  (\S+) +(.+)$", out.split("kinds (--kind):", 1)[1].split("layers", 1)[0], flags=re.M)
    assert [kind for kind, _ in described] == list(KINDS) and all(len(text) > 40 for _, text in described)
    assert "tool-integrated" in dict(described)["tir-otb"]         # not "truncated importance ratio"


@pytest.mark.gpu
def test_torch_drop_ins_conform_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    for target, kind in [("otb_torch:compute_optimal_token_baseline_advantage", "otb"),
                         ("otb_torch:calculate_sum_pi_squared_from_logits", "sum-pi-squared")]:
        report = verify(target, kind, device="cuda", **FAST)
        assert report.conformant, report.to_text()


# ----------------------------------------------------------------------------------------------------------------------
# verdicts, documented deviations, warnings (issue 11)


def _verl_like(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
               handle_zero_tail=True, epsilon=1e-8):
    """The reference, except that ε = 0 with an empty denominator gives 0/0 = NaN, as verl 0.9.1 does."""
    from otb_spec.conformance._deviations import DEVIATIONS

    case = Case("otb", "call", "float64", rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights,
                handle_zero_tail=handle_zero_tail, epsilon=epsilon)
    nan_model = DEVIATIONS[0]
    outputs = nan_model.model(case) if nan_model.applies(case) else case.expected()
    return outputs["advantages"], outputs["returns"]


def test_a_verl_like_port_is_conformant_with_its_documented_deviation_and_fails_only_there_when_strict():
    report = verify(_verl_like, "otb", convention="numpy", layers=("golden",))
    lines = report.to_text().splitlines()
    assert report.conformant and report.exit_status == 0
    assert lines[0] == report.verdict == "CONFORMANT WITH 1 DOCUMENTED DEVIATION"
    deviating = sorted(r.id for r in report.deviations)
    assert deviating and all("epsilon-0" in check_id for check_id in deviating)
    assert report.observed_deviations == ["epsilon-zero-nan"]
    assert "epsilon-zero-nan [by definition] — observed in 4 checks" in report.to_text()
    strict = verify(_verl_like, "otb", convention="numpy", layers=("golden",), strict=True)
    assert strict.verdict == "NOT CONFORMANT" and strict.exit_status == 1
    assert sorted(r.id for r in strict.failures) == deviating
    assert all("failed because of --strict" in r.message for r in strict.failures)


def _returns_and_energy(rewards, response_mask, log_probs, sum_pi_squared, is_weights):
    """(r, m, G, W) in float64 as the two ports below write them: w = 1 − 2π + Σπ² (ρ²), W its masked cumsum."""
    r, m = np.asarray(rewards, np.float64), np.asarray(response_mask, np.float64)
    returns = np.flip(np.cumsum(np.flip(r * m, 1), 1), 1)
    w = 1 - 2 * np.exp(np.asarray(log_probs, np.float64)) + np.asarray(sum_pi_squared, np.float64)
    if is_weights is not None:
        w = w * np.asarray(is_weights, np.float64) ** 2
    return r, m, returns, np.cumsum(w * m, 1)


def _leave_one_out_as_verl_divides(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
                                   epsilon=1e-8, masked_by="product", stray_nan=False):
    """A leave-one-out port written from the formula, dividing as verl does: B = (N − GᵢWᵢmᵢ)/(D − Wᵢmᵢ + ε) with no
    rule for an empty denominator, so ε = 0 gives 0/0 = NaN wherever every other member's Wⱼmⱼ is 0 (singletons
    included); masked positions zeroed by a product ((G − NaN)·0 = NaN) or by a selection. ``stray_nan``: also a NaN
    where the denominator is not empty."""
    r, m, returns, energy = _returns_and_energy(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    _, codes = np.unique([repr(g) for g in list(group_ids)], return_inverse=True)
    codes = codes.reshape(-1)
    numerator, denominator = np.zeros((codes.max() + 1, r.shape[1])), np.zeros((codes.max() + 1, r.shape[1]))
    np.add.at(numerator, codes, returns * energy * m)
    np.add.at(denominator, codes, energy * m)
    with np.errstate(invalid="ignore", divide="ignore"):
        baseline = (numerator[codes] - returns * energy * m) / (denominator[codes] - energy * m + epsilon)
    advantages = (returns - baseline) * m if masked_by == "product" else np.where(m != 0, returns - baseline, 0.0)
    if stray_nan and epsilon == 0.0:
        advantages[np.unravel_index(np.argmax(np.isfinite(advantages) & (m != 0)), m.shape)] = np.nan
    dtype = np.asarray(rewards).dtype
    return advantages.astype(dtype), returns.astype(dtype)


@pytest.mark.parametrize("masked_by", ["product", "selection"])
def test_a_leave_one_out_port_dividing_as_verl_does_is_conformant_with_the_epsilon_zero_deviation(masked_by):
    """verl has no leave-one-out OTB, but a port dividing as verl does gets 0/0 = NaN at ε = 0 where the other members'
    energies are all 0: the documented deviation epsilon-zero-nan, recognised whether the port zeroes masked positions
    by a product (NaN there too) or by a selection (NaN at valid positions only); a NaN anywhere else still fails."""
    def port(*args, **kwargs):
        return _leave_one_out_as_verl_divides(*args, masked_by=masked_by, **kwargs)

    report = verify(port, "loo-otb", convention="numpy", **FAST)
    assert report.conformant and report.observed_deviations == ["epsilon-zero-nan"], report.to_text()
    assert all("epsilon-0" in result.id or "worked-example" in result.id for result in report.deviations)
    assert verify(port, "loo-otb", convention="numpy", strict=True, **FAST).verdict == "NOT CONFORMANT"

    def stray(*args, **kwargs):
        return _leave_one_out_as_verl_divides(*args, masked_by=masked_by, stray_nan=True, **kwargs)

    failed = verify(stray, "loo-otb", convention="numpy", layers=("golden",))
    assert not failed.conformant and failed.failures, failed.to_text()
    assert all("epsilon-0" in result.id or "worked-example" in result.id for result in failed.failures)


def _multi_turn_leave_one_out_as_verl_divides(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *,
                                              is_weights=None, align="position", epsilon=1e-8, stray_nan=False):
    """The multi-turn twin: each row's valid tokens compacted (the k-th valid token in column k), B = (N − GᵢWᵢ)/(D −
    Wᵢ + ε) over the compacted columns with no rule for an empty denominator, scattered back to the valid tokens
    (masked positions stay 0) — so ε = 0 gives NaN at the valid tokens whose column no other member reaches with
    energy."""
    assert align == "valid_token", align
    r, m, returns, energy = _returns_and_energy(rewards, response_mask, log_probs, sum_pi_squared, is_weights)
    rows, positions = np.nonzero(m)
    columns = (np.cumsum(m, 1) - 1)[rows, positions].astype(np.int64)
    width = int(m.sum(1).max()) if m.any() else 1
    compact_returns, compact_energy = np.zeros((m.shape[0], width)), np.zeros((m.shape[0], width))
    compact_returns[rows, columns] = returns[rows, positions]
    compact_energy[rows, columns] = energy[rows, positions]
    _, codes = np.unique([repr(g) for g in list(group_ids)], return_inverse=True)
    codes = codes.reshape(-1)
    numerator, denominator = np.zeros((codes.max() + 1, width)), np.zeros((codes.max() + 1, width))
    np.add.at(numerator, codes, compact_returns * compact_energy)
    np.add.at(denominator, codes, compact_energy)
    with np.errstate(invalid="ignore", divide="ignore"):
        baseline = ((numerator[codes] - compact_returns * compact_energy)
                    / (denominator[codes] - compact_energy + epsilon))
    advantages = np.zeros_like(r)
    advantages[rows, positions] = returns[rows, positions] - baseline[rows, columns]
    if stray_nan and epsilon == 0.0:
        advantages[np.unravel_index(np.argmax(np.isfinite(advantages) & (m != 0)), m.shape)] = np.nan
    dtype = np.asarray(rewards).dtype
    return advantages.astype(dtype), returns.astype(dtype)


def test_a_multi_turn_leave_one_out_port_dividing_as_verl_does_is_conformant_with_the_epsilon_zero_deviation():
    """tir-loo-otb: the 0/0 model of epsilon-zero-nan follows the valid-token alignment (a column no other member
    reaches with energy), so the compacting port above is recognised; a NaN anywhere else still fails."""
    report = verify(_multi_turn_leave_one_out_as_verl_divides, "tir-loo-otb", convention="numpy", **FAST)
    assert report.conformant and report.observed_deviations == ["epsilon-zero-nan"], report.to_text()
    assert all("epsilon-0" in result.id or "worked-example" in result.id for result in report.deviations)
    assert verify(_multi_turn_leave_one_out_as_verl_divides, "tir-loo-otb", convention="numpy", strict=True,
                  **FAST).verdict == "NOT CONFORMANT"

    def stray(*args, **kwargs):
        return _multi_turn_leave_one_out_as_verl_divides(*args, stray_nan=True, **kwargs)

    failed = verify(stray, "tir-loo-otb", convention="numpy", layers=("golden",))
    assert not failed.conformant and failed.failures, failed.to_text()


def _computing_in(dtype_name: str):
    """verl's drop-in (otb_torch's) behind ``.to(dtype)`` of every floating input — a port that calls ``.float()``
    first (float32), or one that rounds its inputs to float16 — returning what it computed."""
    import torch
    import otb_torch

    dtype = getattr(torch, dtype_name)

    def port(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=None,
             handle_zero_tail=True, epsilon=1e-8, **kwargs):
        def narrow(value):
            return None if value is None else value.to(dtype)

        advantages, returns = otb_torch.compute_optimal_token_baseline_advantage(
            narrow(token_level_rewards), response_mask, index, narrow(old_log_probs), narrow(sum_pi_squared),
            narrow(rollout_is_weights), handle_zero_tail=handle_zero_tail, epsilon=epsilon)
        return advantages.to(dtype), returns.to(dtype)

    return port


def test_a_port_computing_in_float32_whatever_its_inputs_is_held_to_float32_only_when_it_says_so():
    """A port that narrows float64 inputs to float32 is less precise than verl (which computes float64 inputs in
    float64): by default its float64 checks fail and the structure layer says how to declare it; with
    working_dtype="float32" it is judged by float32's bound and conforms, float32 outputs of float64 inputs accepted —
    while a port rounding its inputs to float16 still fails, and a float64 port still conforms."""
    pytest.importorskip("torch")
    port = _computing_in("float32")
    default = verify(port, "otb", **FAST)
    assert not default.conformant
    dtypes = next(result for result in default.results if result.id == "otb/structure/dtypes")
    assert dtypes.status == "fail" and "--working-dtype float32" in dtypes.message
    declared = verify(port, "otb", working_dtype="float32", **FAST)
    assert declared.conformant, declared.to_text()
    assert any("working_dtype='float32'" in note for note in declared.notes)
    dtypes = next(result for result in declared.results if result.id == "otb/structure/dtypes")
    assert dtypes.status != "fail" and "float64 inputs" not in dtypes.message, dtypes.message    # bfloat16's noted
    assert not verify(_computing_in("float16"), "otb", working_dtype="float32", **FAST).conformant
    assert verify("otb_spec:optimal_token_baseline", "otb", convention="numpy", working_dtype="float32",
                  **FAST).conformant
    with pytest.raises(TargetError, match="working_dtype: float32 or float64 for the OTB kinds"):
        verify("otb_spec:optimal_token_baseline", "otb", convention="numpy", working_dtype="float16")


@pytest.mark.parametrize("dtypes", ["float32", ("float33",), (), None])
def test_generated_cases_name_bad_dtypes_when_built(dtypes):
    """A string (drawn letter by letter before), an unknown name or nothing: a ValueError naming the argument when the
    strategy is built, not a failure deep inside a comparison."""
    with pytest.raises(ValueError, match=r"^dtypes: expected a non-empty tuple of float64, float32, bfloat16, float16"):
        generated_cases("otb", dtypes=dtypes)


def test_a_documented_deviation_excuses_nothing_else_in_the_same_case():
    def verl_like_and_shifted(*args, **options):
        advantages, returns = _verl_like(*args, **options)
        return advantages + 0.25 * np.asarray(args[1]), returns          # a second bug, at valid tokens
    report = verify(verl_like_and_shifted, "otb", convention="numpy", layers=("golden",))
    failed = {r.id for r in report.failures}
    assert not report.conformant and any("epsilon-0" in check_id for check_id in failed)


def test_every_report_lists_the_deviation_catalogue_of_its_kind():
    report = verify("otb_spec:optimal_token_baseline", "otb", convention="numpy", layers=("golden",))
    text = report.to_text()
    assert text.splitlines()[0] == "CONFORMANT"
    assert "epsilon-zero-nan [by definition] — not observed" in text
    assert "half-precision-lengths [known verl defect] — not observed" in text
    data = report.to_json()
    assert {d["id"]: d["observed"] for d in data["deviations"]} == {"epsilon-zero-nan": False,
                                                                     "half-precision-lengths": False}
    spp = verify("otb_spec:sum_pi_squared", "sum-pi-squared", convention="numpy", layers=("golden",))
    assert "DOCUMENTED DEVIATIONS of verl 0.9.1 for sum-pi-squared: none" in spp.to_text()


_RELEASE = __import__("threading").Event()


def test_a_target_that_hangs_gets_a_verdict_not_a_stuck_terminal():
    def hangs(*args, **kwargs):
        _RELEASE.wait(60)                               # released at the end of the test
        return None

    try:
        start = __import__("time").perf_counter()
        report = verify(hangs, "otb", convention="numpy", timeout=0.5)
        elapsed = __import__("time").perf_counter() - start
    finally:
        _RELEASE.set()
    assert elapsed < 10
    assert report.verdict == "NOT CONFORMANT"
    timed_out = [r for r in report.failures if "timed out" in r.message]
    assert len(timed_out) == 1 and "remaining checks were not run" in timed_out[0].message
    assert not [r for r in report.results if r.layer in ("golden", "generated", "special")]


def test_a_passing_check_reports_its_margin():
    """A passing value check carries how close it came (largest error / allowed, in [0, 1)), in the JSON too."""
    def rounded_otb(rewards, *args, **kwargs):              # the exact answer rounded to the inputs' dtype
        result = otb_spec.optimal_token_baseline(rewards, *args, **kwargs)
        return result.advantages.astype(rewards.dtype), result.returns.astype(rewards.dtype)
    report = verify(rounded_otb, "otb", convention="numpy", layers=("golden",))
    passed = [r for r in report.results if r.status == "pass"]
    assert passed and all(0.0 <= r.ratio < 1.0 for r in passed)
    assert any(r.ratio > 0.0 for r in passed if r.id.endswith("float32"))    # rounded: nonzero errors, within bounds
    assert all(0.0 <= c.worst_ratio < 1.0 for r in passed for c in r.comparisons)


def test_the_cli_exits_1_when_a_target_is_still_running_in_torch(tmp_path):
    """After a timeout the abandoned call may still be inside torch: the command prints the report and leaves with
    exit status 1 — not the abort (134) of an interpreter shutting down under a thread in native code."""
    pytest.importorskip("torch")
    target = tmp_path / "busy.py"
    target.write_text("import time, torch\n"
                      "def otb(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, **options):\n"
                      "    end = time.monotonic() + 60\n"
                      "    while time.monotonic() < end:\n"
                      "        torch.randn(300, 300) @ torch.randn(300, 300)\n")
    result = subprocess.run([sys.executable, "-m", "otb_spec.cli", "verify", f"{target}:otb", "--kind", "otb",
                             "--layer", "golden", "--timeout", "1", "--no-progress"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    assert result.stdout.splitlines()[0] == "NOT CONFORMANT" and "timed out" in result.stdout


def test_an_exception_in_the_target_is_reported_with_its_traceback_and_the_call():
    def inner_step(values):
        raise IndexError("index 7 is out of bounds")

    def crashes(rewards, response_mask, group_ids, log_probs, sum_pi_squared, **options):
        return inner_step(rewards)

    report = verify(crashes, "otb", convention="numpy", layers=("golden",))
    failure = report.failures[0]
    assert "raised IndexError: index 7 is out of bounds" in failure.message
    assert "inner_step" in failure.traceback and "otb_spec/conformance" not in failure.traceback
    assert failure.call.startswith("(rewards=ndarray[") and "handle_zero_tail=" in failure.call
    text = report.to_text()
    assert "traceback (the target's frames):" in text and "called as: target(rewards=ndarray[" in text
    assert "reproduce:" in text


def test_verify_writes_no_hypothesis_folder_into_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    verify("otb_spec:optimal_token_baseline", "otb", convention="numpy", layers=("generated",), max_examples=5)
    assert not (tmp_path / ".hypothesis").exists()


def _epsilon_ignored(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
                     handle_zero_tail=True, epsilon=1e-8):
    return otb_spec.optimal_token_baseline(rewards, response_mask, group_ids, log_probs, sum_pi_squared,
                                           is_weights=is_weights, handle_zero_tail=handle_zero_tail)[:2]


def test_the_report_shows_in_full_the_failure_furthest_outside_its_tolerance():
    report = verify(_epsilon_ignored, "otb", convention="numpy", **FAST)
    worst = max(report.failures, key=lambda r: r.ratio)
    text = report.to_text()
    header, first, rest = text.split("Furthest outside its tolerance", 1)[1].split("\n", 2)
    assert first == f"FAIL {worst.id}" and "reproduce:" in rest.split("\n\n", 1)[0]
    assert worst.ratio > 1e3                                  # ε = 0.5 ignored: far outside, not rounding


def test_numbers_get_the_digits_that_tell_them_apart():
    from otb_spec.conformance._checks import _distinguishing

    got, expected = _distinguishing(0.5000000001, 0.5)
    assert got != expected and float(got) == 0.5000000001 and expected == "0.5"
    assert _distinguishing(0.25, 0.25) == ("0.25", "0.25")
    case = golden_cases("otb", ("float64",))[2]
    bumped = dict(case.expected(), advantages=case.expected()["advantages"] * (1 + 1e-9))
    text = compare(case, bumped)[0].describe()
    got_text, expected_text = re.search(r"got (\S+), expected (\S+) ", text).groups()
    assert got_text != expected_text


def test_a_nan_starting_at_a_masked_position_is_named():
    case = next(c for c in golden_cases("otb", ("float64",)) if c.name.startswith("tool-output holes"))
    masked = tuple(int(i) for i in np.argwhere(case.response_mask == 0)[0])
    advantages = case.expected()["advantages"].copy()
    advantages[masked] = np.nan
    comparison = compare(case, dict(case.expected(), advantages=advantages))[0]
    assert not comparison.ok and comparison.first_nan == masked and comparison.first_nan_masked
    assert "a MASKED position" in comparison.describe()


def test_bit_level_nondeterminism_is_a_warning_and_real_drift_a_failure():
    calls = {"n": 0}

    def jitter(scale):
        def port(*args, **options):
            calls["n"] += 1
            advantages, returns = otb_spec.optimal_token_baseline(*args, **options)[:2]
            return advantages * (1 + scale * (calls["n"] % 2)), returns
        return port

    tiny = {r.id: r for r in verify(jitter(2**-52), "otb", convention="numpy", layers=("structure",)).results}
    assert tiny["otb/structure/deterministic"].status == "warn"
    large = {r.id: r for r in verify(jitter(1e-3), "otb", convention="numpy", layers=("structure",)).results}
    assert large["otb/structure/deterministic"].status == "fail"


def test_outputs_more_precise_than_verl_returns_are_a_warning_less_precise_a_failure():
    torch = pytest.importorskip("torch")
    import otb_torch

    def upcasts(*args, **kwargs):
        return tuple(value.double() for value in otb_torch.compute_optimal_token_baseline_advantage(*args, **kwargs))

    report = verify(upcasts, "otb", layers=("structure", "golden"))
    dtypes = next(r for r in report.results if r.id == "otb/structure/dtypes")
    assert report.conformant and dtypes.status == "warn" and "more precise" in dtypes.message
    assert torch is not None


def test_robustness_to_impossible_inputs_is_a_warning_never_a_failure():
    def unclamped(rewards, response_mask, group_ids, log_probs, sum_pi_squared, *, is_weights=None,
                  handle_zero_tail=True, epsilon=1e-8):
        if np.asarray(log_probs).max() > 0:
            raise FloatingPointError("exp overflow: log π > 0 at a masked position")
        ids = np.unique(np.asarray(group_ids))              # needs orderable ids
        del ids
        return otb_spec.optimal_token_baseline(rewards, response_mask, group_ids, log_probs, sum_pi_squared,
                                               is_weights=is_weights, handle_zero_tail=handle_zero_tail,
                                               epsilon=epsilon)[:2]

    report = verify(unclamped, "otb", convention="numpy", **FAST)
    assert report.conformant, report.to_text()
    warned = [r.id for r in report.warnings]
    assert len(warned) == 3 and all(check_id.startswith("otb/robustness/") for check_id in warned)
    assert "WARNINGS (never a failure)" in report.to_text()


def test_progress_is_reported_and_fail_fast_stops_early():
    labels = []
    verify("otb_spec:optimal_token_baseline", "otb", convention="numpy", layers=("golden",), progress=labels.append)
    assert labels and all(label.startswith("otb ") for label in labels)
    full = verify(_epsilon_ignored, "otb", convention="numpy", layers=("golden", "special"))
    fast = verify(_epsilon_ignored, "otb", convention="numpy", layers=("golden", "special"), fail_fast=True)
    assert not fast.conformant and len(fast.results) < len(full.results) and len(fast.failures) == 1


def test_cli_verify_strict_and_timeout_options():
    status, out, _ = _run_cli("verify", "otb_spec:optimal_token_baseline", "--kind", "otb", "--convention", "numpy",
                              "--layer", "golden", "--strict", "--timeout", "30", "--no-progress")
    assert status == 0 and out.splitlines()[0] == "CONFORMANT"
    status, _, err = _run_cli("verify", "otb_spec:optimal_token_baseline", "--kind", "otb", "--timeout", "-1")
    assert status == 2 and "--timeout" in err


# ----------------------------------------------------------------------------------------------------------------------
# the command line as a user meets it (an audit of the CLI)


def test_a_file_target_imports_its_neighbours_and_its_package(tmp_path, monkeypatch):
    """`otb-spec verify my_trainer/advantages.py:my_otb` where the file imports a module beside it (as `python
    my_trainer/advantages.py` would), or is in a package and imports relatively; and `my_trainer.advantages:my_otb`
    from the current folder (as `python -m`)."""
    package = tmp_path / "my_trainer"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "helpers.py").write_text("from otb_spec import optimal_token_baseline as core\n")
    (package / "beside.py").write_text(
        "import helpers\n\ndef my_otb(*args, **kwargs):\n    result = helpers.core(*args, **kwargs)\n"
        "    return result.advantages, result.returns\n")
    (package / "relative.py").write_text(
        "from .helpers import core\n\ndef my_otb(*args, **kwargs):\n    result = core(*args, **kwargs)\n"
        "    return result.advantages, result.returns\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))                   # what load_target adds is undone
    for target in ("my_trainer/beside.py:my_otb", "my_trainer/relative.py:my_otb", "my_trainer.relative:my_otb"):
        status, out, err = _run_cli("verify", target, "--kind", "otb", "--convention", "numpy", "--layer", "golden",
                                    "--no-progress")
        assert status == 0 and out.startswith("CONFORMANT"), (target, out[:300], err)


def test_an_unwritable_json_path_is_refused_before_any_check(tmp_path):
    status, out, err = _run_cli("verify", "otb_spec:optimal_token_baseline", "--kind", "otb", "--convention", "numpy",
                                "--json", str(tmp_path / "missing" / "report.json"), "--no-progress")
    assert status == 2 and out == "" and "--json: cannot write" in err, (out[:200], err)


def test_structure_checks_are_skipped_not_passed_when_the_target_never_returns():
    def raises(*args, **kwargs):
        raise RuntimeError("not implemented yet")

    report = verify(raises, "otb", convention="numpy", layers=("structure",))
    statuses = {result.id.rsplit("/", 1)[1]: result.status for result in report.results}
    assert statuses.pop("runs") == "fail" and set(statuses.values()) == {"skip"}, statuses
    assert not report.conformant


def test_the_command_line_takes_a_working_dtype_for_an_adapter(capsys):
    """--working-dtype with --adapter: float32 or float64 (the least precision of the per-token arithmetic), said in
    the report's header; half precision is a usage error naming the option."""
    assert main(["verify", "--adapter", "numpy-reference", "--kind", "otb", "--working-dtype", "float32",
                 "--layer", "special", "--no-progress"]) == 0
    assert "working_dtype='float32': per-token arithmetic in at least float32" in capsys.readouterr().out
    assert main(["verify", "--adapter", "numpy-reference", "--kind", "otb", "--working-dtype", "float16",
                 "--no-progress"]) == 2
    assert "working_dtype: float32 or float64 for an adapter" in capsys.readouterr().err


def test_adapter_errors_are_usage_errors(monkeypatch):
    with pytest.raises(TargetError, match=r"^kind: the adapter protocol checks otb, tir-otb, loo-otb, tir-loo-otb, "
                                          r"sum-pi-squared, not fused-token-statistics"):
        verify_adapter("numpy-reference", kinds=("fused-token-statistics",))
    import otb_spec.adapters

    def broken(name, **options):
        raise SyntaxError("invalid syntax (adapter.py, line 46)")

    monkeypatch.setattr(otb_spec.adapters, "load_adapter", broken)
    with pytest.raises(TargetError, match=r"^--adapter: loading 'fw-cpu' failed: SyntaxError"):
        verify_adapter("fw-cpu")


def test_a_skip_pattern_that_matches_nothing_is_warned_about():
    skips = [("otb/golden/worked-example*", "known"), ("otb/goldne/*", "a typo"), ("tir-otb/*", "another kind")]
    report = verify("otb_spec:optimal_token_baseline", "otb", convention="numpy", layers=("golden",), skips=skips)
    warnings = [result.message for result in report.warnings]
    assert report.conformant and len(warnings) == 1, warnings
    assert "'otb/goldne/*' (a typo) matched no check" in warnings[0]
    assert any(result.status == "skip" and "known" in result.message for result in report.results)


def test_the_verl_convention_passes_the_trainers_algorithm_config_and_int64_mask(monkeypatch):
    """verl 0.9.1's trainer calls an estimator with config=self.config.algorithm (a struct-mode DictConfig) and the
    int64 response mask its agent loop builds: the verl convention does the same, with omegaconf or without it (the
    stand-in behaves as struct mode does)."""
    pytest.importorskip("torch")
    import realistic_ports
    from otb_spec.conformance import verl_algorithm_config

    seen = []

    def records_its_arguments(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                              rollout_is_weights=None, config=None, **kwargs):
        seen.append((str(response_mask.dtype), config, rollout_is_weights is not None))
        return realistic_ports.torch_index_add(token_level_rewards, response_mask, index, old_log_probs,
                                               sum_pi_squared, rollout_is_weights, **kwargs)

    for omegaconf_missing in (False, True):
        if omegaconf_missing:
            monkeypatch.setitem(sys.modules, "omegaconf", None)          # import omegaconf raises ImportError
        config = verl_algorithm_config("tir-otb", rollout_is=True)
        assert config.adv_estimator == "tir_optimal_token_baseline" and config["gamma"] == 1.0
        assert config.rollout_correction.rollout_is == "token" and "kl_ctrl" in config
        assert config.get("otb_epsilon", 1e-6) == 1e-6
        with pytest.raises(AttributeError):
            config.otb_epsilon
        with pytest.raises(KeyError):
            config["otb_epsilon"]
        seen.clear()
        report = verify(records_its_arguments, "otb", layers=("golden",))
        assert report.conformant, report.to_text()
        assert {dtype for dtype, _, _ in seen} == {"torch.int64"}
        assert all(found.adv_estimator == "optimal_token_baseline" for _, found, _ in seen)
        # rollout importance weights are on in the config exactly where the call has weights, as in the trainer
        assert {(found.rollout_correction.rollout_is, weighted) for _, found, weighted in seen} == {
            (None, False), ("token", True)}
        assert type(seen[0][1]).__name__ == ("_StructConfig" if omegaconf_missing else "DictConfig")
    with pytest.raises(ValueError, match="kind must be one of"):
        verl_algorithm_config("loo-otb")


def test_assert_matches_reference_names_unknown_outputs_and_rejects_less_precise_ones():
    """A misspelt output raises TypeError naming it (it was ignored, the real one reported missing); outputs returned
    less precisely than the case's inputs fail, as verify's structure check fails them (they were judged with their
    own dtype's rounding and passed); working_dtype reaches the bound as in verify."""
    from otb_spec.conformance import assert_matches_reference

    case = next(c for c in golden_cases("otb", ("float32",)) if c.response_mask.shape[1] > 1)
    expected = case.expected()
    advantages, returns = (expected[name].astype(np.float32) for name in ("advantages", "returns"))
    assert_matches_reference(case, advantages=advantages, returns=returns)
    assert_matches_reference(case, advantages=advantages, returns=returns, working_dtype="float32")
    with pytest.raises(TypeError, match="'advantage'"):
        assert_matches_reference(case, advantage=advantages, returns=returns)
    with pytest.raises(AssertionError, match="returned in float16, less precise than the case's float32"):
        assert_matches_reference(case, advantages=advantages.astype(np.float16), returns=returns)


def test_assert_matches_reference_takes_float32_outputs_of_a_float64_case_at_working_dtype_float32():
    """As verify's structure check: an OTB port computing in float32 whatever its inputs (JAX without x64) may return
    a float64 case in float32 with working_dtype="float32", and is judged by float32's bound; without it, or below
    float32, the outputs fail. For the fused kind working_dtype is a floor: outputs stay held to the inputs' dtype, and
    to its bound."""
    from otb_spec.conformance import assert_matches_reference

    case = next(c for c in golden_cases("otb", ("float64",)) if c.response_mask.shape[1] > 1)
    expected = case.expected()
    advantages, returns = (expected[name].astype(np.float32) for name in ("advantages", "returns"))
    with pytest.raises(AssertionError, match="returned in float32, less precise than the case's float64 inputs"):
        assert_matches_reference(case, advantages=advantages, returns=returns)
    assert_matches_reference(case, advantages=advantages, returns=returns, working_dtype="float32")
    with pytest.raises(AssertionError, match=r"returned in float16, less precise than working_dtype='float32' "
                                             r"\(the case's inputs are float64\)"):
        assert_matches_reference(case, advantages=advantages.astype(np.float16), returns=returns,
                                 working_dtype="float32")
    # held to verify's bound for that target — float32 sums too — not to one summing in float64: an error of 0.8 of
    # it at the element where the two differ most passes
    tolerance = case.tolerances(output_dtype="float32", compute_dtype="float32", working_dtype="float32")["advantages"]
    narrower = case.tolerances(output_dtype="float32", working_dtype="float32")["advantages"]
    allowed, expected_advantages = tolerance._allowed(expected["advantages"]), expected["advantages"]
    worst = np.unravel_index(np.argmax(allowed - narrower._allowed(expected_advantages)), allowed.shape)
    assert allowed[worst] > narrower._allowed(expected_advantages)[worst] / 0.8
    moved = expected_advantages.copy()
    moved[worst] += 0.8 * allowed[worst]
    assert_matches_reference(case, advantages=moved.astype(np.float32), returns=returns, working_dtype="float32")
    with pytest.raises(ValueError, match="^working_dtype: float32 or float64 for the OTB kinds"):
        assert_matches_reference(case, advantages=advantages, returns=returns, working_dtype="float16")
    fused = next(c for c in golden_cases("fused-token-statistics", ("float64",)))
    statistics = {name: value.astype(np.float32) for name, value in fused.expected().items()
                  if name in ("log_probs", "entropy")}
    with pytest.raises(AssertionError, match="returned in float32, less precise than the case's float64 inputs"):
        assert_matches_reference(fused, working_dtype="float32", **statistics)
    # and its bound is float64's there, as verify's: float32-sized errors in float64 outputs fail
    rounded = {name: value.astype(np.float64) for name, value in statistics.items()}
    assert_matches_reference(fused, working_dtype="float32",
                             **{name: value for name, value in fused.expected().items() if name in rounded})
    with pytest.raises(AssertionError, match="log_probs"):
        assert_matches_reference(fused, working_dtype="float32", **rounded)


def test_a_file_target_imports_the_current_folders_packages(tmp_path, monkeypatch):
    """``otb-spec verify trainer/api.py:f`` run from a project's root: api.py's ``from trainer.core import …`` imports,
    as under ``python -m`` (the file's own folder alone was put on the path: "No module named 'trainer'")."""
    from otb_spec.conformance import load_target

    (tmp_path / "trainer").mkdir()
    (tmp_path / "trainer" / "core.py").write_text("def f(*args, **kwargs):\n    return 'core'\n")
    (tmp_path / "trainer" / "api.py").write_text("from trainer.core import f\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    assert load_target("trainer/api.py:f")() == "core"
