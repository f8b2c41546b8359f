"""otb_jax — the JAX port of the otb-spec reference: pure, jit-able, shape-static functions over ``jax.Array``.

    import otb_jax
    ids, num_groups = otb_jax.segment_ids(group_ids)          # once per batch, on the host
    result = otb_jax.optimal_token_baseline(rewards, response_mask, ids, num_groups, log_probs, sum_pi_squared)

JAX needs static shapes, so groups are integer segment ids [B] plus a static number of segments (from
:func:`segment_ids`, which accepts any hashable ids). Everything runs through ``jax.jit`` (no recompilation across
batches of the same shape and options) and works inside your own ``jit`` and under ``vmap`` over an extra batch axis.
Half-precision inputs are accumulated in float32; float64 needs ``jax_enable_x64``. Values are checked (with the
reference's messages) for concrete arrays only — inside a trace they are unknown. Results equal the NumPy reference
``otb_spec`` within the derived tolerances (tests/test_adapters.py, tests/test_jax_adapter.py). Over named mesh axes,
``otb_jax.distributed`` (imported on demand) runs vocab-, data- and context-parallel OTB with ``shard_map``
(docs/distributed.md). ``fused_linear_token_statistics`` gives log π, entropy and Σπ² from hidden states and the LM
head without materialising the logits (a ``lax.scan`` over blocks and a custom VJP).
"""

from otb_jax._fused import fused_linear_token_statistics
from otb_jax._logits import (
    ShardPartials,
    TokenStatistics,
    combine_vocab_shards,
    sum_pi_squared,
    token_statistics_from_logits,
    vocab_shard_partials,
)
from otb_jax._otb import (
    AdvantageResult,
    exact_norm_token_baseline,
    leave_one_out_token_baseline,
    multi_turn_optimal_token_baseline,
    optimal_token_baseline,
    realized_energy_of,
    returns_to_go,
    segment_ids,
    token_baseline,
)
from otb_jax._peers import (
    group_mean_advantage,
    opo_advantage,
    proxy_total_power,
    reinforce_advantage,
    rloo_advantage,
    sequence_optimal_advantage,
)

__all__ = [
    "segment_ids",
    "AdvantageResult",
    "optimal_token_baseline",
    "multi_turn_optimal_token_baseline",
    "leave_one_out_token_baseline",
    "exact_norm_token_baseline",
    "token_baseline",
    "returns_to_go",
    "realized_energy_of",
    "sum_pi_squared",
    "TokenStatistics",
    "token_statistics_from_logits",
    "fused_linear_token_statistics",
    "ShardPartials",
    "vocab_shard_partials",
    "combine_vocab_shards",
    "reinforce_advantage",
    "group_mean_advantage",
    "rloo_advantage",
    "opo_advantage",
    "sequence_optimal_advantage",
    "proxy_total_power",
]
