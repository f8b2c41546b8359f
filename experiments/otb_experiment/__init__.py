"""otb_experiment — a small, reproducible RL run on CPU: does OTB with N = 4 samples per prompt train as well as the
group mean with N = 32, with 35 % of its tokens? And does any arm lose stability when responses are 4–8× longer?
(issues 16 and 26; docs/experiment.md has the pilot, the pre-registered rule and the outcome).

A streaming task with a hidden state and a verifiable terminal reward (:mod:`otb_experiment.task`), a 51k-parameter
GRU policy (:mod:`otb_experiment.policy`), and the training/measurement loop (:mod:`otb_experiment.run`) whose
advantages all come from ``otb_torch`` with Σπ² from the model's own logits. Run it with ``otb-spec experiment``.
Needs torch (and matplotlib for the plot); imported only by that command.
"""

from otb_experiment.run import (ARMS, LONG, MAIN, QUICK_SETUPS, SETUPS, UPDATES, Config, arm_advantages,
                                run_all, run_experiment)

__all__ = ["ARMS", "UPDATES", "Config", "MAIN", "LONG", "SETUPS", "QUICK_SETUPS", "run_experiment", "run_all",
           "arm_advantages"]
