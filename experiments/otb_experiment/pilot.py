"""The pilot of docs/experiment.md, reproducible: each named variant is the main (or long) set-up with a few knobs
changed, run on pilot seeds (100 and up, outside the test seeds) with the same code as the full run.

    python -m otb_experiment.pilot VARIANT [VARIANT …] [--out pilot-output]

prints, per variant and arm, the start and final held-out accuracy, the gain and the paired difference from gm32
per seed, the gradient-norm ratio and the final entropy. Resumable like the full run (same machinery).
"""

from __future__ import annotations

import argparse
import dataclasses
import os

import numpy as np

from otb_experiment.run import Config, run_experiment

__all__ = ["VARIANTS", "main"]

_GM32 = ("gm32",)
_ALL = ("gm32", "otb4", "loo4", "gm4", "rloo4")

# The main set-up as it stood when the pilot began (every knob the pilot might move is spelled out, so that later
# changes to the defaults do not change what a pilot variant ran).
BASE = Config(name="main", min_digits=8, max_digits=32, hidden=64, sft_learning_rate=3e-3, sft_batch=64,
              sft_check_every=10, sft_steps_max=3000, sft_target_accuracy=0.15, validation_prompts=1024,
              test_prompts=4096, prompts_per_step=16, reference_steps=300, token_fraction=0.35, learning_rate=1e-3,
              evaluations=20, checkpoint_every=50, variance_resamples=16, proxy_sequences=12)

VARIANTS = {
    # stage 1: where does gm32 learn? (learning rate, warm-start strength), gm32 only
    "lr3e-4": (BASE, dict(seeds=(100, 101), arms=_GM32, learning_rate=3e-4)),
    "lr1e-3": (BASE, dict(seeds=(100, 101), arms=_GM32, learning_rate=1e-3)),
    "lr3e-3": (BASE, dict(seeds=(100, 101), arms=_GM32, learning_rate=3e-3)),
    # stage 2: how long must gm32 run, and how much do seeds differ?
    "lr1e-3-T600": (BASE, dict(seeds=(100, 101, 102, 103), arms=_GM32, learning_rate=1e-3, reference_steps=600,
                               evaluations=12)),
    "lr2e-3": (BASE, dict(seeds=(100, 101), arms=_GM32, learning_rate=2e-3)),
    # stage 3: every arm where gm32 nears its plateau — the seed-to-seed spread of the paired differences (power)
    "all-T500": (BASE, dict(seeds=(100, 101, 102, 103), arms=_ALL, learning_rate=1e-3, reference_steps=500,
                            evaluations=10)),
    # stage 4: the long-response set-up — does the warm start reach its foothold, where does gm32 learn, the cost?
    "long-gm32-T200": (BASE, dict(name="long", seeds=(100,), arms=_GM32, min_digits=96, max_digits=160,
                                  test_prompts=2048, reference_steps=200, evaluations=8, proxy_sequences=4)),
    # stage 4b: the same with a foothold the sampled policy can stand on (sampled validation accuracy 0.05, about the
    # main warm start's)
    "long-sampled-gm32-T200": (BASE, dict(name="long", seeds=(100,), arms=_GM32, min_digits=96, max_digits=160,
                                          test_prompts=2048, reference_steps=200, evaluations=8, proxy_sequences=4,
                                          sft_measure="sampled", sft_target_accuracy=0.05)),
}


def _describe(name: str, results: dict) -> None:
    print(f"== {name}")
    for key, entry in results["arms"].items():
        start, final, gain = entry["start_accuracy"], entry["final_accuracy"], entry["gain"]
        per_seed = " ".join(f"{a:.3f}" for a in entry["final_accuracy_per_seed"])
        difference = " ".join(f"{d:+.3f}" for d in entry["difference_from_gm32"])
        ratios = " ".join("—" if r is None else f"{r:.1f}" for r in entry["max_norm_ratio"])
        print(f"{key:10s} start {start['mean']:.3f} final {final['mean']:.3f} ± {final['se']:.3f} "
              f"gain {gain['mean']:+.3f} ± {gain['se']:.3f} [{per_seed}]  vs gm32 [{difference}]  "
              f"sampled {entry['final_sampled_accuracy']['mean']:.3f}  entropy {entry['final_entropy']['mean']:.4f}  "
              f"max‖g‖/median {ratios}  spikes {entry['spikes']}  sft steps "
              f"{[w['sft_steps'] for w in entry['warm_start']]}  {entry['seconds']:.0f} s")
        for curve in entry["curves"]:
            print(f"{'':10s} curve " + " ".join(f"{a:.2f}" for a in np.asarray(curve["accuracy"])[::2]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m otb_experiment.pilot", description=__doc__.split("\n\n")[0])
    parser.add_argument("variants", nargs="+", choices=sorted(VARIANTS), metavar="VARIANT")
    parser.add_argument("--out", default="pilot-output")
    args = parser.parse_args(argv)
    for name in args.variants:
        base, changes = VARIANTS[name]
        config = dataclasses.replace(base, **changes)
        results = run_experiment(config, os.path.join(args.out, name), progress=False)
        _describe(name, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
