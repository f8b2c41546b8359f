"""The otb-spec command: version, the demo table, computing on a user's .npz, and clean usage errors."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

import otb_spec as otb
from otb_spec.cli import main
from otb_spec.examples import example_batch


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"otb-spec {otb.__version__}"


def test_demo_prints_the_table_of_the_example_batch(capsys):
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert "A(otb)" in out and "A(otb_loo)" in out and "B(otb)" in out
    batch = example_batch()
    expected = otb.estimate("otb", batch).advantages
    # the first data row is trajectory 0 at t = 0
    first = next(line for line in out.splitlines() if line.strip().startswith("0  prompt-A  0"))
    assert f"{expected[0, 0]:+.4f}" in first


def test_demo_with_estimators_and_options(capsys):
    assert main(["demo", "--estimator", "grpo", "--estimator", "otb", "--no-zero-tail", "--epsilon", "0"]) == 0
    out = capsys.readouterr().out
    assert "A(grpo)" in out and "handle_zero_tail = False" in out


@pytest.mark.bitexact
def test_compute_reads_an_npz_and_writes_the_results(tmp_path, capsys):
    batch = example_batch()
    source = tmp_path / "batch.npz"
    np.savez(source, rewards=batch.rewards, response_mask=batch.response_mask, group_ids=batch.group_ids,
             log_probs=batch.log_probs, sum_pi_squared=batch.sum_pi_squared)
    target = tmp_path / "out.npz"
    assert main(["compute", str(source), "--estimator", "otb_loo", "--output", str(target)]) == 0
    with np.load(target) as result:
        np.testing.assert_array_equal(result["advantages"], otb.estimate("otb_loo", batch).advantages)
    assert main(["compute", str(source)]) == 0
    assert "advantages (otb):" in capsys.readouterr().out


def test_compute_reports_bad_files_with_exit_status_2(tmp_path, capsys):
    incomplete = tmp_path / "bad.npz"
    np.savez(incomplete, rewards=np.zeros((2, 2)))
    assert main(["compute", str(incomplete)]) == 2
    assert "lacks required array(s) response_mask, group_ids" in capsys.readouterr().err
    invalid = tmp_path / "invalid.npz"
    np.savez(invalid, rewards=np.zeros((2, 2)), response_mask=np.full((2, 2), 3.0), group_ids=np.array([0, 0]),
             log_probs=np.zeros((2, 2)), sum_pi_squared=np.ones((2, 2)))
    assert main(["compute", str(invalid)]) == 2
    assert "response_mask: values must be exactly 0 or 1" in capsys.readouterr().err
    assert main(["compute", str(tmp_path / "missing.npz")]) == 2


def test_console_script_runs_as_a_module():
    completed = subprocess.run([sys.executable, "-m", "otb_spec.cli", "--version"], capture_output=True, text=True,
                               check=True)
    assert completed.stdout.startswith("otb-spec ")
