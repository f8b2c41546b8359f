"""otb-spec: the reference specification of the Optimal Token Baseline (OTB) for LLM reinforcement learning.

Li, Xu et al., "The Optimal Token Baseline: Variance Reduction for Long-Horizon LLM-RL", arXiv 2602.07078.

Index convention everywhere: B trajectories × T positions; ``response_mask`` mₜ ∈ {0, 1}; ``group_ids`` [B] of any
hashable ids. Everything is computed in float64 and returned as float64 NumPy arrays; inputs are never modified.

    Σπ²ₜ = exp(lse(2zₜ) − 2·lse(zₜ))                          sum_pi_squared
    wₜ   = 1 − 2πₜ + Σπ²ₜ = ‖∇_z log softmax(zₜ)_{yₜ}‖²      token_energy
    Wₜ   = Σ_{j≤t} mⱼ ρⱼ² wⱼ                                  realized_energy
    Gₜ   = Σ_{k≥t} mₖ rₖ                                      returns_to_go
    Bₜ   = Σᵢ GₜⁱWₜⁱmₜⁱ / (Σᵢ Wₜⁱmₜⁱ + ε)                      optimal_token_baseline (verl semantics)
    Aₜ   = (Gₜ − Bₜ)·mₜ
"""

from otb_spec._version import __version__
from otb_spec.diagnostics import (
    VarianceDiagnostics,
    gradient_variance_diagnostics,
    proxy_total_power,
    variance_diagnostics_from_norms,
    verl_variance_proxy_metrics,
)
from otb_spec.estimators import ESTIMATORS, Estimator, RolloutBatch, estimate
from otb_spec.groups import Segments, group_segments, segment_sums
from otb_spec.identities import leave_one_out_from_self_inclusive
from otb_spec.lm_head import (
    HiddenGradients,
    lm_head_logits,
    token_statistics_from_hidden,
    token_statistics_vjp,
)
from otb_spec.otb import (
    AdvantageResult,
    exact_norm_token_baseline,
    leave_one_out_token_baseline,
    multi_turn_optimal_token_baseline,
    optimal_token_baseline,
    token_baseline,
)
from otb_spec.peers import (
    group_mean_advantage,
    opo_advantage,
    reinforce_advantage,
    rloo_advantage,
    sequence_optimal_advantage,
    sequence_returns,
)
from otb_spec.proxy import (
    ShardPartials,
    TokenStatistics,
    combine_vocab_shards,
    log_softmax,
    log_softmax_jacobian,
    entropy_logit_gradient,
    logit_gradient,
    logsumexp_and_sum_pi_squared,
    sum_pi_squared,
    token_energy,
    token_energy_from_logits,
    token_entropy,
    token_log_probs,
    token_statistics_from_logits,
    vocab_shard_partials,
)
from otb_spec.trajectory import realized_energy, returns_to_go

__all__ = [
    "__version__",
    # proxy
    "sum_pi_squared",
    "logsumexp_and_sum_pi_squared",
    "log_softmax",
    "ShardPartials",
    "vocab_shard_partials",
    "combine_vocab_shards",
    "token_log_probs",
    "token_entropy",
    "TokenStatistics",
    "token_statistics_from_logits",
    "token_energy",
    "token_energy_from_logits",
    "logit_gradient",
    "entropy_logit_gradient",
    "log_softmax_jacobian",
    # from hidden states and the LM head (what fused-linear kernels compute)
    "lm_head_logits",
    "token_statistics_from_hidden",
    "token_statistics_vjp",
    "HiddenGradients",
    # trajectories
    "realized_energy",
    "returns_to_go",
    # groups
    "Segments",
    "group_segments",
    "segment_sums",
    # OTB
    "AdvantageResult",
    "optimal_token_baseline",
    "multi_turn_optimal_token_baseline",
    "leave_one_out_token_baseline",
    "exact_norm_token_baseline",
    "token_baseline",
    "leave_one_out_from_self_inclusive",
    # peers
    "reinforce_advantage",
    "group_mean_advantage",
    "rloo_advantage",
    "opo_advantage",
    "sequence_optimal_advantage",
    "sequence_returns",
    # one interface
    "RolloutBatch",
    "Estimator",
    "ESTIMATORS",
    "estimate",
    # diagnostics
    "VarianceDiagnostics",
    "gradient_variance_diagnostics",
    "variance_diagnostics_from_norms",
    "proxy_total_power",
    "verl_variance_proxy_metrics",
]
