"""A small, fully deterministic example batch (used by ``otb-spec demo``, the README and the docs).

Two prompts × three responses over a five-token vocabulary; the responses have different lengths, one of them is the
unique longest of its group (so the zero tail shows), and one carries a tool-output hole in its mask.
"""

from __future__ import annotations

import numpy as np

from otb_spec.estimators import RolloutBatch
from otb_spec.proxy import sum_pi_squared, token_log_probs

__all__ = ["example_batch"]


def example_batch(seed: int = 0) -> RolloutBatch:
    """A [6, 8] batch with logits [6, 8, 5], consistent log-probs and Σπ², terminal rewards, string group ids.

    Rows 0–2 belong to prompt ``"prompt-A"``, rows 3–5 to ``"prompt-B"`` (interleaved in the batch: A, B, A, B, A, B
    order is not required by anything). Row 4 has tool output at positions 2–3 (mask 0 inside the response).
    """
    rng = np.random.default_rng(seed)
    lengths = np.array([8, 5, 4, 6, 7, 6])
    group_ids = np.array(["prompt-A", "prompt-B", "prompt-A", "prompt-B", "prompt-A", "prompt-B"], dtype=object)
    positions = np.arange(8)
    mask = (positions[None, :] < lengths[:, None]).astype(np.float64)
    mask[4, 2:4] = 0.0
    logits = rng.normal(scale=2.0, size=(6, 8, 5))
    token_ids = rng.integers(0, 5, size=(6, 8))
    log_probs = token_log_probs(logits, token_ids)
    spp = sum_pi_squared(logits)
    rewards = np.zeros((6, 8))
    outcome = np.array([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    last = np.array([np.flatnonzero(row)[-1] for row in mask])
    rewards[np.arange(6), last] = outcome
    return RolloutBatch(rewards=rewards, response_mask=mask, group_ids=group_ids, log_probs=log_probs,
                        sum_pi_squared=spp, logits=logits, token_ids=token_ids)
