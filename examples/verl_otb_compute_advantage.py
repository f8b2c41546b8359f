"""verl 0.9.1's own ``compute_advantage`` with its OTB estimators routed to otb_torch (CPU, no GPU or model needed).

    python examples/verl_otb_compute_advantage.py                       # 64 prompts × 8 responses × 512 tokens
    python examples/verl_otb_compute_advantage.py --prompts 8 --positions 64 --repeats 1

Builds a ``DataProto`` with the keys verl's trainer gives ``compute_advantage`` (string uids as an object array,
rows shuffled as balance_batch leaves them, right-padded response masks, consistent ``old_log_probs`` and
``sum_pi_squared``, terminal rewards), then runs, for both OTB estimators, verl's own function, the port
(``otb_torch.verl.install("verl")``) and the leave-one-out variant (``install("leave_one_out")``), printing the
largest difference from verl's advantages and the median time of each.
"""

from __future__ import annotations

import argparse
import copy
import time
import uuid

import numpy as np
import torch

import otb_torch.verl

__all__ = ["verl_batch", "advantages_and_time", "main"]

ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")
OWN_LABEL = "verl's own"


def verl_batch(prompts: int, responses: int, positions: int, seed: int = 0):
    """A ``verl.DataProto`` of ``prompts × responses`` rows as verl's trainer holds it before ``compute_advantage``."""
    from verl.protocol import DataProto

    rng = np.random.default_rng(seed)
    uids = np.array([str(uuid.UUID(bytes=rng.bytes(16), version=4)) for _ in range(prompts)], dtype=object)
    rows = prompts * responses
    order = rng.permutation(rows)                                     # balance_batch scatters the groups
    lengths = rng.integers(1, positions + 1, size=rows)
    mask = (np.arange(positions)[None, :] < lengths[:, None]).astype(np.float32)
    pi = np.clip(rng.beta(3.0, 1.0, size=mask.shape), 1e-4, 1.0)       # π ≤ 1, π² ≤ Σπ² ≤ 1
    sum_pi_squared = pi**2 + (1 - pi) ** 2 * rng.uniform(size=pi.shape)
    rewards = np.zeros(mask.shape, dtype=np.float32)
    rewards[np.arange(rows), lengths - 1] = rng.integers(0, 2, size=rows)
    return DataProto.from_single_dict({
        "token_level_rewards": torch.from_numpy(rewards),
        "response_mask": torch.from_numpy(mask),
        "old_log_probs": torch.from_numpy((np.log(pi) * mask).astype(np.float32)),
        "sum_pi_squared": torch.from_numpy((sum_pi_squared * mask).astype(np.float32)),
        "uid": np.repeat(uids, responses)[order],
    })


def advantages_and_time(batch, estimator: str, repeats: int) -> tuple[np.ndarray, float]:
    """verl's ``compute_advantage`` as its trainer calls it (ray_trainer.py:1667–1675): (advantages, median seconds
    over ``repeats`` calls after one untimed call, which pays the first use's costs — imports, the native kernel's
    load)."""
    from verl.trainer.config import AlgoConfig
    from verl.trainer.ppo.ray_trainer import compute_advantage

    times, advantages = [], None
    for call in range(repeats + 1):
        data = copy.deepcopy(batch)
        start = time.perf_counter()
        data = compute_advantage(data, adv_estimator=estimator, config=AlgoConfig(adv_estimator=estimator))
        if call:
            times.append(time.perf_counter() - start)
        advantages = data.batch["advantages"].numpy()
    return advantages, float(np.median(times))


def main(argv: list[str] | None = None) -> dict[str, dict[str, tuple[np.ndarray, float]]]:
    """Print the comparison; returns {estimator: {"own" | variant: (advantages, median seconds)}}."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--responses", type=int, default=8)
    parser.add_argument("--positions", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    batch = verl_batch(args.prompts, args.responses, args.positions)
    print(f"batch: {len(batch)} rows × {args.positions} positions, {args.prompts} groups of {args.responses}, "
          f"uids scattered; median of {args.repeats}")
    results: dict[str, dict[str, tuple[np.ndarray, float]]] = {}
    for estimator in ESTIMATORS:
        expected, own_seconds = advantages_and_time(batch, estimator, args.repeats)
        results[estimator] = {"own": (expected, own_seconds)}
        print(f"{estimator}:\n  {OWN_LABEL:26s} {own_seconds * 1e3:8.1f} ms")
        for variant in otb_torch.verl.VARIANTS:
            with otb_torch.verl.install(variant):
                advantages, seconds = advantages_and_time(batch, estimator, args.repeats)
            results[estimator][variant] = (advantages, seconds)
            print(f"  {f'install({variant!r})':26s} {seconds * 1e3:8.1f} ms  ({own_seconds / seconds:4.1f}× faster), "
                  f"max |A − A_verl| = {np.abs(advantages - expected).max():.2e}")
    return results


if __name__ == "__main__":
    main()
