"""The lab report: it runs, covers every cell, answers its question with standard errors, and its full run reproduces
the numbers recorded in docs/lab-results.json."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from otb_spec.cli import main
from otb_spec.lab import ESTIMATOR_LABELS, GROUP_SIZES, N4_VS_N32_VIEWS, format_report, run_lab
from otb_spec.montecarlo import AGGREGATIONS
from otb_spec.tolerances import summation_tolerance

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick():
    return run_lab(quick=True, progress=None)


def test_quick_lab_covers_every_regime_size_aggregation_and_estimator(quick):
    assert [regime.name for regime in quick.regimes] == ["random", "confidence", "long"]
    for regime in quick.regimes:
        assert sorted(quick.aggregated[regime.name]) == sorted(AGGREGATIONS)
        for aggregation in AGGREGATIONS:
            assert sorted(quick.aggregated[regime.name][aggregation]) == list(GROUP_SIZES)
            for n in GROUP_SIZES:
                cell = quick.aggregated[regime.name][aggregation][n]
                assert set(cell) == set(ESTIMATOR_LABELS)
                for estimate in cell.values():
                    assert np.isfinite(estimate.total_variance.value) and estimate.total_variance.value > 0
                    assert np.isfinite(estimate.scale.standard_error) and estimate.scale.standard_error > 0
                    assert estimate.sample_id == cell["reinforce"].sample_id      # one set of groups per cell
        assert quick.estimates[regime.name] is quick.aggregated[regime.name]["sequence_sum"]


def test_quick_lab_unbiased_estimators_have_scale_one(quick):
    """REINFORCE, RLOO, leave-one-out OTB and the oracle: scale within 5 SE of 1 in every cell (sequence sum)."""
    for regime in quick.regimes:
        for n in GROUP_SIZES:
            for name in ("reinforce", "rloo", "otb_loo", "oracle"):
                assert abs(quick.estimates[regime.name][n][name].scale.z_score(1.0)) < 5, (regime.name, n, name)


def test_every_ratio_of_the_report_has_a_standard_error(quick):
    """The printed tables show value±SE in every cell of every ratio, except REINFORCE against itself (exactly 1)."""
    report = format_report(quick)
    assert "Does OTB at N = 4 reach the gradient variance of the group mean at N = 32?" in report
    rows = [line for line in report.splitlines() if line.startswith("   ") and line.split()[0] in ESTIMATOR_LABELS]
    for line in rows:
        words = line.split()
        cells = [word for word in words[3 if words[1] == "÷" else 1:] if not word.startswith("(")]
        assert cells and all("±" in cell or cell.startswith("<") or cell == "1" for cell in cells), line
    data = quick.to_json()
    for regime in data["regimes"].values():
        for n, cell in regime["cells"].items():
            for name, entry in cell.items():
                if entry["tilt_resolved"]:
                    assert entry["tilt_degrees"][1] > 0, (n, name)
                else:
                    assert entry["tilt_degrees"] is None and np.isfinite(entry["tilt_upper_bound_degrees"])
                for key in ("variance_vs_reinforce", "adjusted_variance_vs_reinforce", "variance_times_trajectories",
                            "scale", "perpendicular_bias"):
                    value, error = entry[key]
                    assert np.isfinite(value) and np.isfinite(error), (n, name, key)
                    assert error > 0 or name == "reinforce" and key.endswith("vs_reinforce"), (n, name, key)
        for views in regime["otb_n4_vs_group_mean_n32"].values():
            assert set(views) == set(N4_VS_N32_VIEWS) and all(views[view][1] > 0 for view in views)


def test_recorded_lab_answers_the_n4_vs_n32_question():
    """F1.2: in the recorded full run every verdict of the N = 4 against N = 32 table is decided (more than 5 SE from
    1): "no" for every OTB variant in every regime, raw and per unit of signal, also at an equal budget of trajectories
    per unit of signal; at an equal budget of trajectories or tokens, the raw variance of the self-inclusive variants
    is below the group mean's ("yes") and leave-one-out OTB's is not."""
    recorded = json.loads((ROOT / "docs" / "lab-results.json").read_text())["regimes"]
    for regime, data in recorded.items():
        for name, views in data["otb_n4_vs_group_mean_n32"].items():
            for view, (ratio, error) in views.items():
                budget = view in ("equal_trajectories", "equal_tokens")
                expected_yes = budget and name != "otb_loo"
                if expected_yes:
                    assert ratio + 5 * error <= 1, (regime, name, view, ratio, error)
                else:
                    assert ratio - 5 * error > 1, (regime, name, view, ratio, error)


def test_scale_adjustment_uses_the_exact_scales_of_t3(quick):
    cell = quick.estimates["random"][4]
    assert quick.scale("random", 4, "group_mean") == 0.75
    assert quick.scale("random", 4, "otb_loo") == 1.0
    assert quick.scale("random", 4, "otb") == cell["otb"].scale.value


def test_a_regime_run_alone_samples_what_it_samples_in_the_full_run(quick):
    """``otb-spec lab --regime NAME`` (and ``--group-size``) reproduce the full run's cells bit for bit: each regime's
    seed follows its place among all regimes, not among the chosen ones."""
    for name in ("confidence", "long"):
        alone = run_lab(quick=True, group_sizes=(4,), regime_names=(name,), progress=None)
        for estimator in ("otb", "group_mean"):
            ours, full = alone.cell(name, 4, estimator), quick.cell(name, 4, estimator)
            np.testing.assert_array_equal(ours.mean_gradient, full.mean_gradient)
            assert ours.scale.value == full.scale.value


def test_lab_command_writes_json_and_plot(tmp_path, capsys):
    json_path, plot_path = tmp_path / "lab.json", tmp_path / "plots" / "v.png"
    assert main(["lab", "--quick", "--regime", "random", "--group-size", "4", "--group-size", "32",
                 "--json", str(json_path), "--plot", str(plot_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "== random" in out and "== long" not in out
    data = json.loads(json_path.read_text())
    assert set(data["regimes"]["random"]["cells"]) == {"4", "32"}
    assert set(data["regimes"]["random"]["aggregations"]) == {"token_mean", "sequence_mean"}
    assert set(data["regimes"]["random"]["otb_n4_vs_group_mean_n32"]["otb"]) == set(N4_VS_N32_VIEWS)
    if importlib.util.find_spec("matplotlib") is None:      # the lab extra is not installed: said, and no file
        assert "no plot: matplotlib is not installed" in out and not plot_path.exists()
    else:
        assert plot_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lab_rejects_bad_arguments(capsys):
    assert main(["lab", "--quick", "--group-size", "0", "--no-progress", "--plot", ""]) == 2
    assert "--group-size: must be ≥ 1" in capsys.readouterr().err


@pytest.mark.slow
def test_full_lab_reproduces_the_recorded_results():
    """`otb-spec lab` (full mode, seed 0) gives the numbers committed in docs/lab-results.json — every statistic, ratio
    and standard error, for every loss aggregation (the run is deterministic; the tolerance admits only rounding)."""
    recorded = json.loads((ROOT / "docs" / "lab-results.json").read_text())
    fresh = run_lab(progress=None).to_json()

    def compare(got, expected, where):
        if isinstance(expected, dict):
            assert set(got) == set(expected), where
            for key in expected:
                compare(got[key], expected[key], f"{where}/{key}")
        elif isinstance(expected, (list, float, int)) and not isinstance(expected, bool):
            tolerance = summation_tolerance(2**20, float(np.max(np.abs(expected))) + 1.0)  # 2²⁰ ≥ terms per sum
            tolerance.assert_close(got, expected, where)
        else:
            assert got == expected, where

    for regime, data in recorded["regimes"].items():
        compare(fresh["regimes"][regime], data, regime)
