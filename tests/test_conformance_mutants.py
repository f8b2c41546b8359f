"""Meta-tests: the verifier rejects every deliberately broken implementation and accepts the correct controls.

The mutants (``otb_spec.conformance.mutants``) each carry one realistic bug on top of a correct torch implementation
(the control). One run of the whole table (``otb-spec mutants``, the verifier with its default settings except that
failing cases are not shrunk) backs every test here; docs/conformance.md shows the same table.
"""

from __future__ import annotations

import contextlib
import io
import os
import re

import pytest

pytest.importorskip("torch")

from otb_spec.cli import main  # noqa: E402
from otb_spec.conformance import verify  # noqa: E402
from otb_spec.conformance import mutants as mutants_module  # noqa: E402
from otb_spec.conformance.mutants import CONTROLS, MUTANTS, kill_table  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Bugs that no value comparison of float32/float64 inputs can see, and the layer built to catch each:
STRUCTURAL = {"mutates_inputs": "structure", "upcasts_output": "structure", "fused_mutates_hidden": "structure"}
HALF_PRECISION = {"accumulates_in_input_dtype": "special", "spp_accumulates_in_input_dtype": "special",
                  "fused_accumulates_in_input_dtype": "special"}


@pytest.fixture(scope="module")
def table():
    return kill_table(max_examples=100, seed=0)


def test_there_are_at_least_twelve_distinct_realistic_bugs():
    assert len(MUTANTS) >= 12
    assert len({mutant.bug for mutant in MUTANTS.values()}) == len(MUTANTS)
    assert {mutant.kind for mutant in MUTANTS.values()} == {"otb", "tir-otb", "sum-pi-squared",
                                                            "fused-token-statistics"}


@pytest.mark.parametrize("name", list(MUTANTS))
def test_verifier_rejects_mutant(table, name):
    row = next(row for row in table.rows if row[0].name == name)
    mutant, failed, killed = row
    assert killed, f"{name} ({mutant.bug}) passed every check"
    assert sum(failed.values()) > 0


def test_verifier_accepts_the_controls(table):
    assert table.controls_pass, table.controls
    assert {kind for _, kind, _ in table.controls} == set(CONTROLS)


def test_golden_and_generated_cases_each_reject_every_value_bug(table):
    """The hand-built cases and the property-based ones each find every semantic bug without help from the other."""
    for mutant, failed, _ in table.rows:
        if mutant.name not in STRUCTURAL and mutant.name not in HALF_PRECISION:
            assert failed["generated"] > 0, f"{mutant.name}: no generated profile failed"
            assert failed["golden"] > 0, f"{mutant.name}: no golden case failed"


def test_structural_and_half_precision_bugs_are_caught_by_their_layer(table):
    for mutant, failed, _ in table.rows:
        layer = STRUCTURAL.get(mutant.name) or HALF_PRECISION.get(mutant.name)
        if layer is not None:
            assert failed[layer] > 0, f"{mutant.name}: the {layer} layer did not catch it"


def test_mutants_are_loadable_by_name_and_keep_verl_signatures():
    for mutant in MUTANTS.values():
        assert getattr(mutants_module, mutant.name) is mutant.function
        assert mutant.target == f"otb_spec.conformance.mutants:{mutant.name}"
        assert mutant.bug in mutant.function.__doc__


def test_a_mutant_report_points_at_its_bug():
    report = verify(MUTANTS["zero_tail_ignored"].target, "otb", max_examples=30, layers=("golden",))
    failed = [r.id for r in report.failures]
    assert any("unique-longest" in check_id for check_id in failed)
    assert not any("handle-zero-tail-false" in check_id for check_id in failed)   # without the zero tail: correct


def test_docs_kill_table_lists_every_mutant_with_its_verdict(table):
    with open(os.path.join(ROOT, "docs", "conformance.md"), encoding="utf-8") as handle:
        text = handle.read()
    documented = dict(re.findall(r"^\| `(\w+)` \|.*\| (killed|SURVIVED) \|", text, flags=re.M))
    assert documented == {mutant.name: "killed" for mutant, _, killed in table.rows if killed}
    assert f"kill rate {table.kill_rate}" in text


def test_cli_mutants_prints_the_table(table, monkeypatch):
    monkeypatch.setattr(mutants_module, "kill_table", lambda **options: table)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = main(["mutants", "--markdown"])
    assert status == 0
    assert out.getvalue().count("| killed |") == len(MUTANTS)
    assert f"kill rate {len(MUTANTS)}/{len(MUTANTS)}" in out.getvalue()
