"""Speed of the NumPy reference at trainer scale.

    python benchmarks/bench_reference.py [--rows 2048] [--positions 4096] [--group-size 8] [--repeats 5]

Prints the median wall time of each public entry point on a batch of ``rows`` trajectories × ``positions`` tokens
(groups of ``group-size``, shuffled string ids, random lengths, tool-output holes in a quarter of the rows, IS
weights), and the ratio to the target in issue 2: OTB at 2048 × 4096 in well under a second on a 2-core machine.
Validation of the inputs is included in every timing (it is part of what a user pays).
"""

from __future__ import annotations

import argparse
import os
import platform
import time

import numpy as np

import otb_spec as otb


def make_batch(rows: int, positions: int, group_size: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(positions // 8, positions + 1, size=rows)
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float32)
    holes = rng.uniform(size=rows) < 0.25
    for row in np.flatnonzero(holes):
        start = rng.integers(1, max(2, lengths[row] - 64))
        mask[row, start:start + 32] = 0.0
    ids = np.array([f"prompt-{g}" for g in range(rows // group_size) for _ in range(group_size)], dtype=object)
    ids = ids[rng.permutation(rows)]
    pi = rng.beta(5.0, 1.0, size=(rows, positions))
    spp = (pi**2 + (1 - pi) ** 2 * rng.uniform(0.01, 1.0, size=(rows, positions))).astype(np.float32)
    rewards = np.zeros((rows, positions), dtype=np.float32)
    rewards[np.arange(rows), lengths - 1] = rng.integers(0, 2, size=rows)
    return dict(rewards=rewards, response_mask=mask, group_ids=ids, log_probs=np.log(pi).astype(np.float32),
                sum_pi_squared=spp, is_weights=rng.uniform(0.5, 1.5, size=(rows, positions)).astype(np.float32))


def timed(function, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        function()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2048)
    parser.add_argument("--positions", type=int, default=4096)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    batch = make_batch(args.rows, args.positions, args.group_size)
    args_otb = (batch["rewards"], batch["response_mask"], batch["group_ids"], batch["log_probs"],
                batch["sum_pi_squared"])
    print(f"otb-spec {otb.__version__} reference benchmark — numpy {np.__version__}, python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs ({platform.processor() or platform.machine()})")
    print(f"batch: {args.rows} trajectories × {args.positions} positions, groups of {args.group_size}, float32 inputs, "
          f"{int(batch['response_mask'].sum()):,} valid tokens")
    cases = {
        "optimal_token_baseline (single-turn, ρ)": lambda: otb.optimal_token_baseline(
            *args_otb, is_weights=batch["is_weights"]),
        "multi_turn_optimal_token_baseline": lambda: otb.multi_turn_optimal_token_baseline(*args_otb),
        "leave_one_out_token_baseline": lambda: otb.leave_one_out_token_baseline(*args_otb),
        "group_mean_advantage (GRPO)": lambda: otb.group_mean_advantage(
            batch["rewards"], batch["response_mask"], batch["group_ids"], normalize_by_std=True),
    }
    target = 1.0
    print(f"{'function':45s} {'median s':>10s} {'Mtok/s':>8s} {'vs 1 s target':>14s}")
    tokens = args.rows * args.positions
    for name, function in cases.items():
        seconds = timed(function, args.repeats)
        print(f"{name:45s} {seconds:10.3f} {tokens / seconds / 1e6:8.1f} {seconds / target:13.2f}×")
    logits = np.random.default_rng(1).normal(scale=3.0, size=(4096, 32768)).astype(np.float32)
    seconds = timed(lambda: otb.sum_pi_squared(logits), max(1, args.repeats // 2))
    print(f"{'sum_pi_squared [4096, 32768] float32 logits':45s} {seconds:10.3f} "
          f"{logits.size / seconds / 1e9:7.2f}G logits/s")


if __name__ == "__main__":
    main()
