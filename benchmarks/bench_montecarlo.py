"""Throughput of the Monte Carlo lab engine (issue target: ≥ 1e6 sampled trajectories per second on the toy).

    python benchmarks/bench_montecarlo.py [--trajectories 1048576]

Prints, for the lab's enumerable toy (shared parameters, V = 4, T = 5) and for the long-horizon Markov toy (T = 200):
the sampling rate alone, and the end-to-end rate of `run_monte_carlo` (sampling, advantages, per-group gradients and
statistics) with one estimator (OTB) and with all ten lab estimators, in trajectories per second.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from otb_spec import montecarlo as mc
from otb_spec.lab import ESTIMATOR_LABELS, regimes

TARGET = 1e6


def rate(function, count: int) -> float:
    start = time.perf_counter()
    function()
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=2**20)
    args = parser.parse_args()
    random_regime, _, long_regime = regimes(quick=False)
    print(f"{'task':20s} {'what':32s} {'trajectories/s':>15s} {'vs 1e6 target':>14s}")
    for regime, count in ((random_regime, args.trajectories), (long_regime, max(2**12, args.trajectories // 256))):
        task = regime.task
        oracle = mc.constant_baseline_estimator(
            mc.oracle_baselines(task) if regime.name != "long" else np.zeros(task.horizon))
        all_estimators = {name: name for name in ESTIMATOR_LABELS if name != "oracle"} | {"oracle": oracle}
        label = f"{regime.name} (T={task.horizon})"
        def sample_in_chunks(task=task, count=count, chunk=2**17):
            rng = np.random.default_rng(0)
            for start in range(0, count, chunk):
                task.sample(min(chunk, count - start), rng)

        cases = {
            "sampling only (chunks of 2^17)": sample_in_chunks,
            "end to end, OTB": lambda: mc.run_monte_carlo(task, ["otb"], group_size=8, n_groups=count // 8, seed=0),
            "end to end, 10 estimators": lambda: mc.run_monte_carlo(task, all_estimators, group_size=8,
                                                                    n_groups=count // 8, seed=0),
        }
        for what, function in cases.items():
            value = rate(function, count)
            print(f"{label:20s} {what:32s} {value:15,.0f} {value / TARGET:13.2f}×")


if __name__ == "__main__":
    main()
