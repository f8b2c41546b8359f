"""otb_torch — the PyTorch port of the otb-spec reference (CPU and CUDA), and verl 0.9.1 drop-ins.

    from otb_torch import compute_optimal_token_baseline_advantage           # same signature as verl's
    advantages, returns = compute_optimal_token_baseline_advantage(
        token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared)

Everything is vectorized (no Python loop over groups or tokens), runs under ``torch.no_grad()``, accumulates in
float32 (float64 for float64 inputs; bfloat16/float16 accepted) and returns tensors on the input's device in the
rewards' dtype. Group ids are mapped to integer segments once on the host; pass precomputed
:class:`Segments` (``segments_from_index``) to skip that, and ``check_values=False`` to skip the one host
synchronisation of the value checks — the computation itself never synchronises and has static shapes, so it runs
under ``torch.compile`` and CUDA graphs. Results equal the NumPy reference ``otb_spec`` within the derived tolerances
(``otb_spec.tolerances``); tests/test_adapters.py proves it.

On CPU every OTB variant with a plan (the drop-ins, ``optimal_token_baseline``, ``multi_turn_optimal_token_baseline``,
``leave_one_out_token_baseline`` in both alignments) and each rank's compute in ``otb_torch.distributed`` run a native
kernel built on first use with the system's C compiler (one sweep per group, rows in any order; a few seconds, once
per machine, cached); without a compiler, or with ``OTB_TORCH_NATIVE=0``, the eager kernel runs instead.
``native_kernel_status()`` says which, and why (docs/performance.md).

Across processes, ``otb_torch.distributed`` (imported on demand) computes vocab-parallel Σπ², log π and entropy, and
OTB for batches split over data- and context-parallel ranks (docs/distributed.md).

To make verl 0.9.1 itself call the port, ``import otb_torch.verl`` and ``otb_torch.verl.install()`` (or
``install(variant="leave_one_out")`` for the unbiased estimator under verl's OTB names; ``uninstall()`` undoes it) —
imported on demand, so ``otb_torch`` never imports verl (docs/verl.md).

For TRL 1.16, ``from otb_torch.trl import OTBGRPOTrainer`` — ``trl.GRPOTrainer`` with per-token OTB advantages
(imported on demand too; needs the ``trl`` extra; docs/trl.md).
"""

from otb_torch._core import Segments, segments_from_index
from otb_torch._fused import fused_linear_token_statistics
from otb_torch._logits import (
    ShardPartials,
    TokenStatistics,
    calculate_sum_pi_squared_from_logits,
    combine_vocab_shards,
    sum_pi_squared,
    token_statistics_from_logits,
    vocab_shard_partials,
)
from otb_torch._native import NativeKernelStatus, native_kernel_status
from otb_torch._otb import (
    AdvantageResult,
    compute_multi_turn_optimal_token_baseline_advantage,
    compute_optimal_token_baseline_advantage,
    exact_norm_token_baseline,
    leave_one_out_token_baseline,
    multi_turn_optimal_token_baseline,
    optimal_token_baseline,
    realized_energy_of,
    returns_to_go,
    token_baseline_from_energy,
)
from otb_torch._peers import (
    group_mean_advantage,
    opo_advantage,
    proxy_total_power,
    reinforce_advantage,
    rloo_advantage,
    sequence_optimal_advantage,
)

__all__ = [
    # verl drop-ins
    "compute_optimal_token_baseline_advantage",
    "compute_multi_turn_optimal_token_baseline_advantage",
    "calculate_sum_pi_squared_from_logits",
    # segments
    "Segments",
    "segments_from_index",
    # the reference's API on tensors
    "AdvantageResult",
    "optimal_token_baseline",
    "multi_turn_optimal_token_baseline",
    "leave_one_out_token_baseline",
    "exact_norm_token_baseline",
    "token_baseline_from_energy",
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
    # the native CPU kernel
    "NativeKernelStatus",
    "native_kernel_status",
]
