"""The lab report: it runs, covers every cell, answers its question with standard errors, and its full run reproduces
the numbers recorded in docs/lab-results.json."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from otb_spec.cli import main
from otb_spec.lab import ESTIMATOR_LABELS, GROUP_SIZES, format_report, run_lab

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick():
    return run_lab(quick=True, progress=None)


def test_quick_lab_covers_every_regime_size_and_estimator(quick):
    assert [regime.name for regime in quick.regimes] == ["random", "confidence", "long"]
    for regime in quick.regimes:
        assert sorted(quick.estimates[regime.name]) == list(GROUP_SIZES)
        for n in GROUP_SIZES:
            cell = quick.estimates[regime.name][n]
            assert set(cell) == set(ESTIMATOR_LABELS)
            for estimate in cell.values():
                assert np.isfinite(estimate.total_variance.value) and estimate.total_variance.value > 0
                assert np.isfinite(estimate.scale.standard_error)


def test_quick_lab_unbiased_estimators_have_scale_one(quick):
    """REINFORCE, RLOO, leave-one-out OTB and the oracle: scale within 5 SE of 1 in every cell."""
    for regime in quick.regimes:
        for n in GROUP_SIZES:
            for name in ("reinforce", "rloo", "otb_loo", "oracle"):
                assert abs(quick.estimates[regime.name][n][name].scale.z_score(1.0)) < 5, (regime.name, n, name)


def test_lab_answers_the_n4_vs_n32_question_in_quick_mode(quick):
    """No regime shows OTB (any variant) at N = 4 significantly below the group mean at N = 32."""
    report = format_report(quick)
    assert "Does OTB at N = 4 reach the gradient variance of the group mean at N = 32?" in report
    for regime in quick.regimes:
        for name in ("otb", "otb_loo", "otb_exact"):
            ratio = quick.n4_vs_n32(regime.name, name, False)
            error = quick.n4_vs_n32_standard_error(regime.name, name, False)
            assert not ratio + 5 * error <= 1, (regime.name, name)


def test_scale_adjustment_uses_the_exact_scales_of_t3(quick):
    cell = quick.estimates["random"][4]
    assert quick.scale("random", 4, "group_mean") == 0.75
    assert quick.scale("random", 4, "otb_loo") == 1.0
    assert quick.scale("random", 4, "otb") == cell["otb"].scale.value


def test_lab_command_writes_json_and_plot(tmp_path, capsys):
    json_path, plot_path = tmp_path / "lab.json", tmp_path / "plots" / "v.png"
    assert main(["lab", "--quick", "--regime", "random", "--group-size", "4", "--group-size", "32",
                 "--json", str(json_path), "--plot", str(plot_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "== random" in out and "== long" not in out
    data = json.loads(json_path.read_text())
    assert set(data["regimes"]["random"]["cells"]) == {"4", "32"}
    assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lab_rejects_bad_arguments(capsys):
    assert main(["lab", "--quick", "--group-size", "0", "--no-progress", "--plot", ""]) == 2
    assert "--group-size: must be ≥ 1" in capsys.readouterr().err


@pytest.mark.slow
def test_full_lab_reproduces_the_recorded_results():
    """`otb-spec lab` (full mode, seed 0) gives the numbers committed in docs/lab-results.json."""
    recorded = json.loads((ROOT / "docs" / "lab-results.json").read_text())
    fresh = run_lab(progress=None).to_json()
    for regime, data in recorded["regimes"].items():
        for n, cell in data["cells"].items():
            for name, values in cell.items():
                got = fresh["regimes"][regime]["cells"][n][name]
                for key in ("scale", "cosine", "total_variance"):
                    np.testing.assert_allclose(got[key], values[key], rtol=1e-9, atol=1e-12,
                                               err_msg=f"{regime} N={n} {name} {key}")
