"""otb_experiment — a small, reproducible RL run on CPU: does OTB with N = 4 samples per prompt match the group mean
with N = 32, per token consumed? (issue 16; docs/experiment.md has the pre-registered rule and the outcome).

A long-horizon synthetic task with a verifiable terminal reward (:mod:`otb_experiment.task`), a 45k-parameter GRU
policy (:mod:`otb_experiment.policy`), and the training/measurement loop (:mod:`otb_experiment.run`) whose
advantages all come from ``otb_torch`` with Σπ² from the model's own logits. Run it with ``otb-spec experiment``.
Needs torch (and matplotlib for the plot); imported only by that command.
"""

from otb_experiment.run import ARMS, FULL, QUICK, UPDATES, Config, arm_advantages, run_experiment

__all__ = ["ARMS", "UPDATES", "Config", "FULL", "QUICK", "run_experiment", "arm_advantages"]
