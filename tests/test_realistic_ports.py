"""The verifier's verdicts hold on realistic code: every correct port in the net is accepted (float32 and float64
inputs, bfloat16 in the special cases), every realistic porting bug is rejected (tests/realistic_ports.py)."""

from __future__ import annotations

import contextlib
import inspect
import io
import re

import pytest

from otb_spec.conformance import KINDS, verify

torch = pytest.importorskip("torch")

import realistic_ports  # noqa: E402  (tests/ is on sys.path; needs torch)

FAST = dict(max_examples=15, shrink_budget=0)


@pytest.mark.parametrize("name", sorted(realistic_ports.CORRECT))
def test_every_correct_port_is_accepted(name):
    kind, convention, function = realistic_ports.CORRECT[name]
    report = verify(function, kind, convention=convention, **FAST)
    assert report.conformant, report.to_text()
    # ports that divide as verl does (ε = 0: 0/0 = NaN) show exactly that documented deviation, nothing else
    assert set(report.observed_deviations) <= {"epsilon-zero-nan"}, report.to_text()
    dtypes = {r.id.rsplit("/", 1)[-1] for r in report.results if r.layer in ("golden", "special") and r.status == "pass"}
    assert {"float32", "float64"} <= dtypes


@pytest.mark.parametrize("name", sorted(realistic_ports.CALLED_POSITIONALLY))
def test_a_port_verls_trainer_could_not_call_is_checked_positionally_with_a_warning(name):
    kind, convention, function = realistic_ports.CALLED_POSITIONALLY[name]
    report = verify(function, kind, convention=convention, **FAST)
    assert report.conformant, report.to_text()
    (signature,) = [r for r in report.results if r.layer == "signature"]
    assert signature.status == "warn" and "verl's trainer could not call this target" in signature.message, \
        report.to_text()

    def off_by_one_percent(*args, **kwargs):                                    # the values are still checked
        advantages, returns = function(*args, **kwargs)
        return advantages * 1.01, returns

    off_by_one_percent.__signature__ = inspect.signature(function)             # called positionally as well
    report = verify(off_by_one_percent, kind, convention=convention, fail_fast=True, **FAST)
    assert not report.conformant and report.results[0].status == "warn"


@pytest.mark.parametrize("name", sorted(realistic_ports.BUGGY))
def test_every_realistic_bug_is_rejected(name):
    kind, convention, function, bug = realistic_ports.BUGGY[name]
    report = verify(function, kind, convention=convention, fail_fast=True, **FAST)
    assert not report.conformant, f"{name} ({bug}) was accepted:\n{report.to_text()}"


def test_the_net_is_as_wide_as_promised():
    assert len(realistic_ports.CORRECT) >= 10 and len(realistic_ports.BUGGY) >= 20
    assert {kind for kind, _, _ in realistic_ports.CORRECT.values()} == set(KINDS)


def test_sum_pi_squared_ports_held_to_float32_with_working_dtype():
    """working_dtype="float32" holds a Σπ² port to the bound of a program that widens half-precision logits first:
    every correct port (all widen) still passes, and running totals kept in bfloat16/float16 — within the default
    bound, which must admit verl's log-sum-exps rounded to the logits' dtype — fail."""
    options = dict(FAST, layers=("golden", "special"))
    for name, (kind, convention, function) in realistic_ports.CORRECT.items():
        if kind == "sum-pi-squared":
            report = verify(function, kind, convention=convention, working_dtype="float32", **options)
            assert report.conformant, f"{name}:\n{report.to_text()}"
    half = realistic_ports._variant(realistic_ports.spp_chunked_online, "half_running_totals")
    report = verify(half, "sum-pi-squared", working_dtype="float32", **options)
    assert not report.conformant
    assert {r.id.rsplit("/", 1)[-1] for r in report.failures} <= {"bfloat16", "float16"}, report.to_text()


def test_a_verl_convention_snippet_reproduces_a_failure_from_defaults():
    """A bug that shows only through the trainer's keyword call (the zero tail off by default): the report's snippet
    makes the same call — verl's keywords, the options left out at verl's defaults — and prints the same error."""
    kind, convention, function, _ = realistic_ports.BUGGY["zero_tail_off_by_default"]
    report = verify(function, kind, convention=convention, layers=("golden",))
    failure = next(r for r in report.failures if r.snippet and "handle_zero_tail=True" in r.case)
    call = next(line for line in failure.snippet.splitlines() if line.startswith("got_advantages, got_returns ="))
    assert "config=otb_spec.conformance.verl_algorithm_config('otb', rollout_is=" in call
    assert "response_mask=torch.as_tensor(response_mask).to(device='cpu', dtype=torch.int64)" in call
    assert "handle_zero_tail" not in call and "epsilon" not in call
    advantages = next(c for c in failure.comparisons if c.output == "advantages")
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(re.sub(r"^from \S+ import \S+ as target$", "target = port", failure.snippet, flags=re.M),
             {"port": function})
    numbers = [float(x) for x in re.findall(r"advantages ([0-9.e+-]+)", printed.getvalue())]
    assert numbers and numbers[0] == pytest.approx(advantages.max_abs_error, rel=1e-6)
