"""Power analysis for the pre-registered rule (docs/experiment.md, "Power"), from a pilot's results.

For each N = 4 arm the pilot gives paired differences D_s = final accuracy − gm32's final accuracy (seed s). Model:
D_s ~ Normal(μ, σ²) independently over seeds and arms, μ = the pilot mean, σ = the pilot standard deviation raised
to its one-sided 80 % upper confidence limit (σ·√((k − 1)/χ²_{0.2, k−1}) from k pilot seeds), because a few seeds
estimate σ poorly. For n seeds the rule's t-interval is simulated (the mean ~ Normal(μ, σ²/n), the variance
~ σ²χ²_{n−1}/(n − 1)), giving each arm's chance of "matches", "falls short" and "undecided", and the claim's chance
of "supported", "not supported" and "undecided". A second table gives, for each n, the distance |μ + δ| from the
margin at which one arm's verdict is decisive with probability 0.9.

    python -m otb_experiment.power pilot-output/<variant>/results.json [--seeds 5 10 20 30]
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
from scipy import optimize, stats

__all__ = ["verdict_probabilities", "claim_probabilities", "decisive_distance", "main"]

_ARMS = ("otb4", "loo4", "gm4", "rloo4")


def verdict_probabilities(mu: float, sigma: float, seeds: int, margin: float, confidence: float,
                          draws: int = 40_000, seed: int = 0) -> dict[str, float]:
    """P(matches), P(falls short), P(undecided) of one arm whose differences are Normal(mu, sigma²), n = seeds."""
    rng = np.random.default_rng(seed)
    mean = rng.normal(mu, sigma / math.sqrt(seeds), draws)
    sd = sigma * np.sqrt(rng.chisquare(seeds - 1, draws) / (seeds - 1))
    half = stats.t.ppf(0.5 + confidence / 2, seeds - 1) * sd / math.sqrt(seeds)
    matches = mean - half >= -margin
    short = mean + half < -margin
    return {"matches": float(matches.mean()), "falls short": float(short.mean()),
            "undecided": float((~matches & ~short).mean())}


def claim_probabilities(arms: dict[str, dict[str, float]]) -> dict[str, float]:
    """P(supported), P(not supported), P(undecided) of the claim from independent arms' verdict probabilities."""
    otb, gm, rloo = arms["otb4"], arms["gm4"], arms["rloo4"]
    supported = otb["matches"] * gm["falls short"] * rloo["falls short"]
    neither_matches = (1 - gm["matches"]) * (1 - rloo["matches"])
    not_supported = otb["falls short"] + (1 - otb["falls short"]) * (1 - neither_matches)
    return {"supported": supported, "not supported": not_supported,
            "undecided": max(0.0, 1 - supported - not_supported)}


def decisive_distance(sigma: float, seeds: int, confidence: float, power: float = 0.9) -> float:
    """The distance |μ + δ| from the margin at which an arm's verdict is decisive with probability ``power``."""
    def shortfall(distance: float) -> float:
        p = verdict_probabilities(-0.0 + distance, sigma, seeds, 0.0, confidence, draws=20_000)
        return p["matches"] - power
    return float(optimize.brentq(shortfall, 1e-6, 10 * sigma + 1e-6, xtol=1e-5))


def _upper_sigma(values: np.ndarray, level: float = 0.8) -> float:
    k = len(values)
    return float(values.std(ddof=1) * math.sqrt((k - 1) / stats.chi2.ppf(1 - level, k - 1)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m otb_experiment.power", description=__doc__.split("\n\n")[0])
    parser.add_argument("results", help="a pilot's results.json with every arm on the same seeds")
    parser.add_argument("--seeds", type=int, nargs="+", default=[5, 10, 15, 20, 25, 30, 40])
    args = parser.parse_args(argv)
    with open(args.results, encoding="utf-8") as handle:
        results = json.load(handle)
    config = results["config"]
    margin, confidence = config["margin"], config["confidence"]
    model = {}
    print(f"pilot: {args.results} (seeds {config['seeds']}); margin δ = {margin}, {confidence:.0%} t-intervals")
    gain = results["arms"]["pg/gm32"]["gain"]
    print(f"gm32 gain over the warm start: {gain['mean']:+.3f} ± {gain['se']:.3f} (per seed "
          f"{[round(a - b, 3) for a, b in zip(results['arms']['pg/gm32']['final_accuracy_per_seed'], [c['accuracy'][0] for c in results['arms']['pg/gm32']['curves']])]})")  # noqa: E501
    print("\n| arm | pilot mean D | pilot SD | SD used (80 % upper limit) |\n|---|---|---|---|")
    for arm in _ARMS:
        values = np.asarray(results["arms"][f"pg/{arm}"]["difference_from_gm32"], dtype=float)
        model[arm] = (float(values.mean()), _upper_sigma(values))
        print(f"| {arm} | {values.mean():+.3f} | {values.std(ddof=1):.3f} | {model[arm][1]:.3f} |")
    print("\nIf the pilot means are the truth:\n")
    print("| seeds | " + " | ".join(f"{arm}: matches / falls short / undecided" for arm in _ARMS)
          + " | claim: supported / not supported / undecided |")
    print("|---|" + "---|" * (len(_ARMS) + 1))
    for seeds in args.seeds:
        arms = {arm: verdict_probabilities(mu, sigma, seeds, margin, confidence) for arm, (mu, sigma) in model.items()}
        claim = claim_probabilities(arms)
        cells = [" / ".join(f"{arms[arm][v]:.2f}" for v in ("matches", "falls short", "undecided")) for arm in _ARMS]
        print(f"| {seeds} | " + " | ".join(cells) + " | "
              + " / ".join(f"{claim[v]:.2f}" for v in ("supported", "not supported", "undecided")) + " |")
    speeds = {arm: dict(zip(results["arms"][f"pg/{arm}"]["seeds"],
                             results["arms"][f"pg/{arm}"]["mean_accuracy_over_run"])) for arm in _ARMS}
    print("\nSecondary (learning speed, otb4 minus the other arm; the interval must exclude 0): P(resolved) if the "
          "pilot means are the truth\n")
    print("| pair | pilot mean | pilot SD | SD used | " + " | ".join(f"{s} seeds" for s in args.seeds) + " |")
    print("|---|---|---|---|" + "---|" * len(args.seeds))
    for other in ("gm4", "rloo4", "loo4"):
        values = np.array([speeds["otb4"][s] - speeds[other][s] for s in speeds["otb4"] if s in speeds[other]])
        mu, sd_used = float(values.mean()), _upper_sigma(values)
        cells = []
        for seeds in args.seeds:
            p = verdict_probabilities(abs(mu), sd_used, seeds, 0.0, confidence)
            cells.append(f"{p['matches']:.2f}")
        print(f"| otb4 − {other} | {mu:+.3f} | {values.std(ddof=1):.3f} | {sd_used:.3f} | " + " | ".join(cells) + " |")
    sigma = max(s for _, s in model.values())
    print(f"\nDistance |μ + δ| from the margin at which one arm's verdict is decisive with probability 0.9 "
          f"(σ = {sigma:.3f}, the largest used):\n")
    print("| seeds | " + " | ".join(str(s) for s in args.seeds) + " |\n|---|" + "---|" * len(args.seeds))
    print("| distance | " + " | ".join(f"{decisive_distance(sigma, s, confidence):.3f}" for s in args.seeds) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
