"""Per-token OTB and leave-one-out OTB in TRL 1.16's ``GRPOTrainer``, on one process or many.

    from otb_torch.trl import OTBGRPOTrainer

    trainer = OTBGRPOTrainer(model, reward_funcs, args=GRPOConfig(..., scale_rewards="none"), train_dataset=dataset,
                             variant="leave_one_out")          # or "otb" (verl's self-inclusive OTB, the default)
    trainer.train()

For trajectory i of a prompt group at completion position t, with mask mₜ (TRL's completion mask times its tool mask),
the sequence reward r of TRL's reward functions at the completion's last valid token, π and Σπ² of the sampling
policy and TRL's importance-sampling ratio ρ (vLLM generation, 1 otherwise):

    Gₜ = Σ_{k≥t} mₖrₖ,   Wₜ = Σ_{j≤t} mⱼρⱼ²(1 − 2πⱼ + Σπ²ⱼ),
    Bₜ = Σⱼ GₜʲWₜʲmₜʲ / (Σⱼ Wₜʲmₜʲ + ε)     (variant "otb": the sums run over the whole group, verl's estimator)
    Bₜ⁽ⁱ⁾ = Σ_{j≠i} … / (Σ_{j≠i} … + ε)     (variant "leave_one_out": the other members only, each W read as
                                            max(W, 0), 0 unless their energy is positive; unbiased, proofs/T3)
    Aₜ = (Gₜ − Bₜ)·mₜ  → TRL's loss as [B, T] advantages.

How TRL 1.16.0 is entered (line numbers of the installed ``trl/trainer/grpo_trainer.py``; docs/trl.md has them all):

* ``_compute_loss`` unsqueezes only 1-D advantages (:3055–3059), so the [B, T] advantages that
  ``_generate_and_score_completions`` (:2324) returns in ``output["advantages"]`` reach the loss per token.
* ``_calculate_rewards`` (:1579) returns the rewards of every process (gathered, :1679–1681); the override keeps them.
* ``_get_per_token_logps_and_entropies`` (:1419) runs the policy through TRL's fused LM head (never the logits),
  which the trainer re-installs with ``log_sum_sq_probs`` among its outputs (TRL's kernel accumulates Σ_v e^{2(z_v−m)}
  in the tiles of log π; trainer/utils.py:1548). log π(yₜ) and Σπ²ₜ of the sampling policy are then the
  ``log_probs`` and exp(``log_sum_sq_probs``) of one of TRL's own forwards: its no-grad old-log-prob forward
  (:2634–2657) when TRL runs one; otherwise its loss forward when that sees the whole generation batch at the sampling
  weights (one micro-batch per generation, one iteration — TRL's defaults), the advantages being put into the inputs
  before ``_compute_loss`` reads them (:3054); otherwise one no-grad call of the same fused forward by the trainer.
  No LM-head pass is added in the first two cases.
* With several processes, the rows of a prompt group sit on different processes (TRL slices the gathered batch with
  ``process_slice``, :2812–2818): :func:`otb_torch.distributed.distributed_token_baseline` over the default process
  group (accelerate's) gives every process the advantages one process would compute for its rows, within rounding.

``import otb_torch`` never imports this module; importing it needs trl (``pip install "otb-spec[trl]"``).
"""

from __future__ import annotations

import contextlib
import inspect
import math
import sys
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

import otb_torch
from otb_spec import _validation as reference_checks

try:
    import trl
    from accelerate.utils import is_peft_model
    from trl import GRPOConfig, GRPOTrainer
    from trl.models.utils import disable_gradient_checkpointing
    from trl.trainer.utils import add_fused_lm_head
except ImportError as _exc:  # pragma: no cover - exercised by tests/test_trl_integration.py in a subprocess
    raise ModuleNotFoundError(
        f"otb_torch.trl needs trl 1.16.x ({_exc}); install it with: pip install \"otb-spec[trl]\"",
        name=getattr(_exc, "name", None) or "trl") from _exc

__all__ = [
    "OTBGRPOTrainer",
    "OTBBatch",
    "VARIANTS",
    "ALIGNMENTS",
    "SUPPORTED_TRL_SERIES",
    "ACCEPTED_LOSS_TYPES",
]

VARIANTS = ("otb", "leave_one_out")
"""``"otb"``: verl's self-inclusive OTB (biased: a member's own terms are in its baseline).
``"leave_one_out"``: the baseline of member i from the other members only — unbiased (proofs/T3)."""

ALIGNMENTS = reference_checks.ALIGNMENTS
"""``"position"``: members compared at the same completion position (verl's ``optimal_token_baseline``).
``"valid_token"``: the k-th valid token of each member (tool output skipped; verl's ``tir_optimal_token_baseline``)."""

SUPPORTED_TRL_SERIES = "1.16"
"""The trl release series the overrides were written and tested against; another version raises at construction."""

ACCEPTED_LOSS_TYPES = ("dapo", "bnpo", "grpo", "dr_grpo", "cispo", "sapo")
"""``GRPOConfig.loss_type`` values that keep their meaning with per-token advantages (docs/trl.md has the table)."""

_REJECTED_LOSS_TYPES = {
    "luspo": "LUSPO is a sequence-level objective (it needs importance_sampling_level='sequence' and scales each "
             "sequence's loss by its length), so per-token advantages collapse to their sum",
    "vespo": "VESPO weights each sequence by φ(w) with parameters chosen by the sign of the sequence's advantage; with "
             "per-token advantages the sign, hence the weighting, varies inside a sequence, which is no longer VESPO",
}

# Keyword arguments of GRPOTrainer._get_per_token_logps_and_entropies that carry multimodal inputs; the trainer passes
# them from the generation output as TRL's _compute_loss does (grpo_trainer.py:3030–3047).
_FORWARD_KEYS = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
                 "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids")


class OTBBatch(NamedTuple):
    """What OTB was computed from and what it gave, on this process, for the last generation batch ([B, T] over the
    completion positions; rows in the order OTB saw them — TRL's generation order, or its shuffled order when the
    statistics come from the loss's forward: ``row_ids`` tells).

    Attributes:
      rewards: TRL's sequence reward (weighted sum over the reward functions) at each completion's last valid token,
        0 elsewhere; 0 for a completion every reward function left unscored (None).
      response_mask: completion mask × tool mask (1 on tokens the policy generated); 0 on an unscored completion.
      group_ids: [B] int64 prompt-group ids over all processes (global row index // num_generations).
      log_probs, sum_pi_squared: log π(yₜ) and Σπ²ₜ of the sampling policy (0 on padding).
      is_weights: TRL's importance-sampling ratio ρ as [B, T], or None without vLLM's correction.
      advantages, returns, baselines: Aₜ, Gₜ, Bₜ — ``advantages`` is what TRL's loss receives.
      num_groups: the number of prompt groups over all processes.
      row_ids: [B] int64 global index of each row in TRL's generation batch (all processes, generation order).
    """

    rewards: torch.Tensor
    response_mask: torch.Tensor
    group_ids: torch.Tensor
    log_probs: torch.Tensor
    sum_pi_squared: torch.Tensor
    is_weights: torch.Tensor | None
    advantages: torch.Tensor
    returns: torch.Tensor
    baselines: torch.Tensor
    num_groups: int
    row_ids: torch.Tensor


# The OTB inputs that travel with TRL's generation output until the loss's forward gives the statistics (TRL shuffles
# and splits every tensor of the output along the rows, grpo_trainer.py:1541–1545).
_PENDING_KEYS = ("otb_rewards", "otb_response_mask", "otb_group_ids", "otb_row_ids", "otb_is_weights")


# ----------------------------------------------------------------------------------------------------------------------
# log π and Σπ² from TRL's fused LM head


_LOG_SUM_SQ_PROBS = "log_sum_sq_probs"
"""The field of TRL's ``FusedCausalLMOutput`` that carries log Σ_v π_v² per token (trainer/utils.py:1541)."""


def _trl_fused_forward_closure(forward: Any) -> dict[str, Any] | None:
    """The variables that TRL's fused forward closes over (``original_forward``, ``temperature``,
    ``cast_lm_head_to_fp32``, ``outputs``, …), or None when ``forward`` is not a forward made by
    ``trl.trainer.utils.add_fused_lm_head`` (its ``_fused_forward``, bound to the model as an instance attribute)."""
    function = getattr(forward, "__func__", None)
    code = getattr(function, "__code__", None)
    if code is None or code not in add_fused_lm_head.__code__.co_consts or function.__closure__ is None:
        return None
    return {name: cell.cell_contents for name, cell in zip(code.co_freevars, function.__closure__)}


def _request_log_sum_sq_probs(policy: Any) -> None:
    """Re-install TRL's fused LM head on ``policy`` with log Σπ² among its outputs.

    GRPOTrainer (grpo_trainer.py:1068–1073) patches the policy with ``add_fused_lm_head(..., outputs=("log_probs",
    "entropy"))``, which sets an instance ``forward`` closing over those outputs (trainer/utils.py:1548–1688). TRL's
    kernel accumulates S₂ = Σ_v e^{2(z_v − m)} beside S₁ = Σ_v e^{z_v − m} in the same tiles when asked
    (``log_sum_sq_probs`` = log S₂ − 2·log S₁ = log Σπ², kernels/chunked_logprob.py). Every fused forward TRL installed
    is removed (a policy reused by a second trainer carries one per construction), the forward they wrapped restored,
    and the head installed once more with TRL's own temperature and ``cast_lm_head_to_fp32`` and TRL's outputs plus
    ``log_sum_sq_probs`` — so the policy is wrapped once, and TRL's log π and entropy are computed as before."""
    closure = _trl_fused_forward_closure(vars(policy).get("forward"))
    if closure is None:
        raise RuntimeError(
            f"otb_torch.trl: the forward of the policy ({type(policy).__name__}) is not the fused LM head that trl "
            f"1.16's GRPOTrainer installs (trl.trainer.utils.add_fused_lm_head); something replaced it, so Σπ² cannot "
            "be requested from TRL's head")
    settings = closure
    while closure is not None:                      # unwrap every fused forward TRL installed
        del policy.forward
        original = closure["original_forward"]
        if not (getattr(original, "__func__", None) is type(policy).forward
                and getattr(original, "__self__", None) is policy):
            policy.forward = original               # a forward that was not the class's: TRL wrapped it; keep it
        closure = _trl_fused_forward_closure(vars(policy).get("forward"))
    outputs = tuple(settings["outputs"])
    if _LOG_SUM_SQ_PROBS not in outputs:
        outputs += (_LOG_SUM_SQ_PROBS,)
    add_fused_lm_head(policy, temperature=settings["temperature"],
                      cast_lm_head_to_fp32=settings["cast_lm_head_to_fp32"], outputs=outputs)


@dataclass
class _StatisticsCapture:
    """Stands in for the policy inside TRL's ``_get_per_token_logps_and_entropies``, which calls
    ``model(**inputs, labels=labels, fused_lm_head=True)`` once per row chunk (grpo_trainer.py:1497–1498) and keeps
    ``outputs.log_probs[:, -logits_to_keep:]``. Each call runs ``model`` exactly as TRL would and returns TRL's outputs
    unchanged; it records, detached, log π(yₜ) = ``outputs.log_probs`` and Σπ²ₜ = exp(``outputs.log_sum_sq_probs``) of
    the completion tokens — both from the same tiles of TRL's fused head in that call (0 where TRL scores nothing)."""

    model: Any
    logits_to_keep: int
    log_probs: list[torch.Tensor] = field(default_factory=list)
    sum_pi_squared: list[torch.Tensor] = field(default_factory=list)

    def __call__(self, *args: Any, labels: torch.Tensor | None = None, fused_lm_head: bool = False,
                 **inputs: Any) -> Any:
        if args or labels is None or fused_lm_head is not True:
            raise RuntimeError("otb_torch.trl: GRPOTrainer._get_per_token_logps_and_entropies called the policy in a "
                               "way trl 1.16 does not (model(**inputs, labels=..., fused_lm_head=True) expected)")
        outputs = self.model(**inputs, labels=labels, fused_lm_head=True)
        log_sum_sq_probs = getattr(outputs, _LOG_SUM_SQ_PROBS, None)
        if log_sum_sq_probs is None:
            raise RuntimeError("otb_torch.trl: the policy's fused LM head returned no log_sum_sq_probs: its forward is "
                               "no longer the one OTBGRPOTrainer installed (something replaced model.forward after "
                               "the trainer was built)")
        k = self.logits_to_keep
        log_probs = outputs.log_probs[:, -k:].detach().float()
        unscored = (labels[:, -k:] == -100).to(log_probs.device)
        self.log_probs.append(log_probs.masked_fill(unscored, 0.0))
        self.sum_pi_squared.append(log_sum_sq_probs[:, -k:].detach().float().exp().masked_fill(unscored, 0.0))
        return outputs

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat(self.log_probs), torch.cat(self.sum_pi_squared)


@dataclass
class _Generation:
    """State of one ``_generate_and_score_completions`` call: whether TRL's old-log-prob forward is still to be served,
    the statistics taken from it, and TRL's gathered rewards."""

    serve_old_log_probs: bool
    statistics: tuple[torch.Tensor, torch.Tensor] | None = None
    rewards_per_func: torch.Tensor | None = None


# ----------------------------------------------------------------------------------------------------------------------
# the trainer


def _invalid_option(exc: Exception) -> ValueError:
    return ValueError(str(exc))


class OTBGRPOTrainer(GRPOTrainer):
    """``trl.GRPOTrainer`` with per-token OTB advantages: Aₜ = (Gₜ − Bₜ)·mₜ in place of GRPO's group-centred sequence
    reward, for every loss TRL computes from ``advantages``.

    Takes every argument of ``trl.GRPOTrainer`` (1.16), plus, keyword-only:

    Args:
      variant: ``"otb"`` — verl 0.9.1's OTB, Bₜ = Σⱼ GₜʲWₜʲmₜʲ / (Σⱼ Wₜʲmₜʲ + ε) over the whole prompt group
        (``otb_torch.optimal_token_baseline`` / ``multi_turn_optimal_token_baseline``); ``"leave_one_out"`` — the sums
        over the other members j ≠ i (``otb_torch.leave_one_out_token_baseline``), unbiased.
      align: ``"position"`` — members compared at equal completion positions; ``"valid_token"`` — the k-th valid token
        of each member (tool output, where TRL's tool mask is 0, is skipped: verl's multi-turn OTB).
      epsilon: ε ≥ 0 of the baseline's denominator (not ``GRPOConfig.epsilon``, TRL's clipping range).
      handle_zero_tail: verl's zero tail (the unique longest member's baseline is 0 beyond the second-longest length).
        None, the default, means verl's choice for each variant: on for ``"otb"`` (verl's default, so the variant is
        verl's estimator) and off for ``"leave_one_out"``, where it has nothing to do (no other member is valid there,
        so the baseline is already 0); True with ``"leave_one_out"`` is an error.

    log π and Σπ² of the sampling policy come from the same tiles of TRL's fused LM head in one of TRL's forwards
    (docs/trl.md, "Where log π and Σπ² come from"): TRL's old-log-prob forward when TRL runs one; else, when TRL's loss
    sees the whole generation batch at the sampling weights in one forward (one micro-batch per generation, one
    iteration: TRL's default), that forward; else one no-grad call of TRL's fused forward by the trainer. The policy's
    fused head is re-installed at construction with ``log_sum_sq_probs`` among its outputs.

    Configuration (checked before the model loads; docs/trl.md has the table): ``scale_rewards`` must be ``"none"``,
    ``multi_objective_aggregation`` ``"sum_then_normalize"``, ``importance_sampling_level`` ``"token"``, ``loss_type``
    one of :data:`ACCEPTED_LOSS_TYPES`. ``args=None`` gives TRL's default config with ``scale_rewards="none"``.

    After each batch's advantages, :attr:`otb_batch` holds this process's :class:`OTBBatch`, and ``self._metrics[mode]``
    receives the ``otb/…`` metrics (docs/trl.md, "Metrics").

    Raises:
      ValueError: an unknown argument, an invalid option, or a configuration that would distort per-token advantages
        (the message names the argument). RuntimeError: trl is not 1.16.x.
    """

    otb_batch: OTBBatch | None

    def __init__(self, *args: Any, variant: str = "otb", align: str = "position", epsilon: float = 1e-8,
                 handle_zero_tail: bool | None = None, **kwargs: Any) -> None:
        _check_trl_version()
        bound = _bind_trainer_arguments(args, kwargs)
        if not isinstance(variant, str) or variant not in VARIANTS:
            raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
        align = reference_checks.alignment(align)
        if handle_zero_tail is not None and not isinstance(handle_zero_tail, bool):
            raise ValueError(f"handle_zero_tail: expected None, True or False, got {handle_zero_tail!r}")
        try:
            epsilon = reference_checks.epsilon(epsilon)
            zero_tail = reference_checks.zero_tail(handle_zero_tail, variant == "leave_one_out")
        except (TypeError, ValueError) as exc:
            raise _invalid_option(exc) from exc
        config = bound.arguments.get("args")
        if config is None:
            model = bound.arguments.get("model")
            name = model if isinstance(model, str) else getattr(getattr(model, "config", None), "_name_or_path", "")
            config = GRPOConfig(f"{name.split('/')[-1]}-GRPO", scale_rewards="none")   # TRL's default (:324–328)
            bound.arguments["args"] = config
        _check_config(config)
        self.otb_variant, self.otb_align = variant, align
        self.otb_epsilon, self.otb_handle_zero_tail = epsilon, zero_tail
        self.otb_batch = None
        self._otb_generation: _Generation | None = None
        self._otb_loss_inputs: dict[str, Any] | None = None
        super().__init__(*bound.args[1:], **bound.kwargs)
        # the policy's fused LM head also returns log Σπ², from the tiles of its log π (grpo_trainer.py:1068–1073 patch
        # the PEFT base model, as here)
        policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
        _request_log_sum_sq_probs(policy)

    # -- TRL's methods ------------------------------------------------------------------------------------------------

    def _trl_computes_old_log_probs(self) -> bool:
        """TRL's own condition for its no-grad old-log-prob forward (grpo_trainer.py:2642–2645)."""
        generate_every = self.args.steps_per_generation * self.num_iterations
        return (self.args.gradient_accumulation_steps % generate_every != 0
                or bool(self.use_vllm and self.vllm_importance_sampling_correction))

    def _otb_loss_sees_the_generation(self, mode: str) -> bool:
        """Whether TRL's loss forward runs once on the whole generation batch at the sampling weights: in training,
        one micro-batch per generation (``steps_per_generation`` = 1, the batch split in one piece, :1539–1546) used
        once (``num_iterations`` = 1); in evaluation always (the batch goes to the loss as generated, :1547–1550)."""
        return mode == "eval" or (self.args.steps_per_generation == 1 and self.num_iterations == 1)

    def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> torch.Tensor:
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        _check_rewards(rewards_per_func, self.reward_func_names, self.reward_weights)
        if self._otb_generation is not None:
            self._otb_generation.rewards_per_func = rewards_per_func
        return rewards_per_func

    def _get_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, *args: Any, **kwargs: Any) -> tuple:
        with _unreduced_head_guard(model) if torch.is_grad_enabled() else contextlib.nullcontext():
            return self._otb_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep, *args,
                                                           **kwargs)

    def _otb_per_token_logps_and_entropies(self, model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                                           logits_to_keep: int, *args: Any, **kwargs: Any) -> tuple:
        generation, pending = self._otb_generation, self._otb_loss_inputs
        if pending is not None and not pending.get("otb_done", True):
            # the loss's forward (_compute_loss, :3030–3047): take the statistics from it, then put OTB's advantages
            # in the inputs, which _compute_loss reads after this forward (:3054)
            capture = _StatisticsCapture(model, logits_to_keep)
            result = super()._get_per_token_logps_and_entropies(capture, input_ids, attention_mask, logits_to_keep,
                                                                *args, **kwargs)
            pending["advantages"] = self._otb_complete(pending, *capture.result())
            pending["otb_done"] = True
            return result
        if generation is None or not generation.serve_old_log_probs or model is not self.model:
            return super()._get_per_token_logps_and_entropies(model, input_ids, attention_mask, logits_to_keep,
                                                              *args, **kwargs)
        # TRL's first policy forward inside _generate_and_score_completions when it computes old log-probs: that one
        # (grpo_trainer.py:2646–2655; the reference model's forward comes after it, :2710–2738)
        generation.serve_old_log_probs = False
        if torch.is_grad_enabled() or args or kwargs.get("compute_entropy") or kwargs.get("compute_aux_loss"):
            raise RuntimeError("otb_torch.trl: the old-log-prob forward of trl 1.16 runs without gradient, entropy or "
                               "auxiliary loss; this trl calls it differently")
        capture = _StatisticsCapture(model, logits_to_keep)
        result = super()._get_per_token_logps_and_entropies(capture, input_ids, attention_mask, logits_to_keep,
                                                            **kwargs)
        generation.statistics = capture.result()
        return result

    def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
        mode = "train" if self.model.training else "eval"
        generation = _Generation(serve_old_log_probs=self._trl_computes_old_log_probs())
        self._otb_generation = generation
        try:
            output = super()._generate_and_score_completions(inputs)
        finally:
            self._otb_generation = None
        if generation.serve_old_log_probs:
            raise RuntimeError("otb_torch.trl: trl 1.16 computes old log-probs here but this trl did not call "
                               "_get_per_token_logps_and_entropies for them")
        if generation.rewards_per_func is None:
            raise RuntimeError("otb_torch.trl: this trl did not call _calculate_rewards inside "
                               "_generate_and_score_completions")
        output.update(self._otb_inputs(output, generation.rewards_per_func, mode))
        if generation.statistics is None and self._otb_loss_sees_the_generation(mode):
            # the loss's forward will give log π and Σπ²; until then the advantages are NaN, so that a loss computed
            # without them could not pass for a trained one (_compute_loss refuses that case)
            output["advantages"] = torch.full(output["completion_mask"].shape, math.nan,
                                              device=output["completion_mask"].device)
            return output
        statistics = generation.statistics if generation.statistics is not None else self._otb_forward(output)
        output["advantages"] = self._otb_complete(output, *statistics)
        for key in _PENDING_KEYS:
            output.pop(key, None)
        return output

    def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> torch.Tensor:
        if "otb_group_ids" not in inputs:
            return super()._compute_loss(model, inputs)
        inputs["otb_done"] = False
        self._otb_loss_inputs = inputs
        try:
            loss = super()._compute_loss(model, inputs)
        finally:
            self._otb_loss_inputs = None
        if not inputs.pop("otb_done"):
            raise RuntimeError("otb_torch.trl: GRPOTrainer._compute_loss computed a loss without running the policy "
                               "through _get_per_token_logps_and_entropies; OTB's advantages were never set")
        return loss

    # -- OTB ----------------------------------------------------------------------------------------------------------

    def _otb_forward(self, output: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """log π and Σπ² of the completions under the policy that sampled them, when neither TRL's old-log-prob forward
        nor its loss forward can give them: one no-grad call of TRL's fused forward through TRL's own chunked helper,
        with TRL's batch size and multimodal inputs, as TRL's old-log-prob forward runs (:2634–2655)."""
        mode = "train" if self.model.training else "eval"
        completion_ids = output["completion_ids"]
        logits_to_keep = completion_ids.size(1)
        input_ids = torch.cat([output["prompt_ids"], completion_ids], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        batch_size = self.args.per_device_train_batch_size if mode == "train" else self.args.per_device_eval_batch_size
        capture = _StatisticsCapture(self.model, logits_to_keep)
        extra = {key: output[key] for key in _FORWARD_KEYS if output.get(key) is not None}
        with torch.no_grad(), disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs):
            super()._get_per_token_logps_and_entropies(capture, input_ids, attention_mask, logits_to_keep,
                                                       batch_size=batch_size, **extra)
        return capture.result()

    def _otb_inputs(self, output: dict[str, Any], rewards_per_func: torch.Tensor, mode: str) -> dict[str, Any]:
        """The per-row OTB inputs of this process's rows (the ``otb_*`` keys): rewards at the last valid token, the
        response mask, global group and row ids, TRL's importance-sampling ratio as [B, T] (absent without it)."""
        completion_mask = output["completion_mask"]
        device = completion_mask.device
        mask = completion_mask if output.get("tool_mask") is None else completion_mask * output["tool_mask"]
        rows, positions = mask.shape
        offset = self.accelerator.process_index * rows
        # TRL's sequence reward (grpo_trainer.py:2763, 2826): weighted sum over the reward functions; a completion that
        # every function left unscored (NaN) gets no reward and leaves its group (TRL zeroes its advantage, :2808–2810)
        local = rewards_per_func[offset:offset + rows].to(device)
        unscored = torch.isnan(local).all(dim=1)
        reward = (local * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        valid = (mask != 0) & ~unscored.unsqueeze(1)
        last = torch.where(valid, torch.arange(positions, device=device), -1).amax(dim=1)
        rewards = torch.zeros((rows, positions), dtype=torch.float32, device=device)
        scored_rows = torch.nonzero(last >= 0).squeeze(1)
        rewards[scored_rows, last[scored_rows]] = reward[scored_rows].float()
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        row_ids = torch.arange(offset, offset + rows, device=device)
        pending = {"otb_rewards": rewards, "otb_response_mask": valid.to(torch.float32),
                   "otb_group_ids": torch.div(row_ids, num_generations, rounding_mode="floor"),
                   "otb_row_ids": row_ids}
        ratio = output.get("importance_sampling_ratio")
        if ratio is not None:
            pending["otb_is_weights"] = ratio.float().expand(rows, positions).contiguous()
        return pending

    def _otb_complete(self, rows: dict[str, Any], log_probs: torch.Tensor, sum_pi_squared: torch.Tensor
                      ) -> torch.Tensor:
        """OTB's advantages for this process's ``rows`` (the ``otb_*`` inputs, in any row order) given log π and Σπ²;
        records :attr:`otb_batch`, logs the metrics and the completions table. Returns the [B, T] advantages."""
        mode = "train" if self.model.training else "eval"
        rewards, response_mask = rows["otb_rewards"], rows["otb_response_mask"]
        group_ids, is_weights = rows["otb_group_ids"], rows.get("otb_is_weights")
        num_generations = self.num_generations if mode == "train" else self.num_generations_eval
        num_groups = -(-rewards.shape[0] * self.accelerator.num_processes // num_generations)
        log_probs, sum_pi_squared = log_probs.float(), sum_pi_squared.float()
        leave_one_out = self.otb_variant == "leave_one_out"
        options = dict(is_weights=is_weights, epsilon=self.otb_epsilon)
        if self.accelerator.num_processes > 1:
            from otb_torch.distributed import distributed_token_baseline

            result = distributed_token_baseline(
                rewards, response_mask, group_ids, log_probs, sum_pi_squared, num_groups=num_groups,
                align=self.otb_align, leave_one_out=leave_one_out, handle_zero_tail=self.otb_handle_zero_tail,
                timeout=float(self.args.ddp_timeout), **options)
        elif leave_one_out:
            result = otb_torch.leave_one_out_token_baseline(rewards, response_mask, group_ids, log_probs,
                                                            sum_pi_squared, align=self.otb_align, **options)
        else:
            function = (otb_torch.optimal_token_baseline if self.otb_align == "position"
                        else otb_torch.multi_turn_optimal_token_baseline)
            result = function(rewards, response_mask, group_ids, log_probs, sum_pi_squared,
                              handle_zero_tail=self.otb_handle_zero_tail, **options)
        batch = OTBBatch(rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights, result.advantages,
                         result.returns, result.baselines, num_groups, rows["otb_row_ids"])
        self.otb_batch = batch
        self._otb_log(batch, mode)
        return batch.advantages

    def _otb_log(self, batch: OTBBatch, mode: str) -> None:
        """The ``otb/…`` metrics over all processes (one gather of 16 numbers per process), and the completions
        table's advantage column: Aₜ at each completion's first valid token (TRL logged its group-centred reward,
        :2837), placed by global row id (one gather of 2 numbers per row)."""
        valid = batch.response_mask != 0
        energy = otb_torch.realized_energy_of(batch.log_probs, batch.sum_pi_squared, batch.response_mask,
                                              is_weights=batch.is_weights, check_values=False)
        power = otb_torch.proxy_total_power(batch.advantages, batch.response_mask, batch.log_probs,
                                            batch.sum_pi_squared, is_weights=batch.is_weights, check_values=False)
        scored_rows = valid.any(dim=1)
        a, g, b = (tensor[valid].double() for tensor in (batch.advantages, batch.returns, batch.baselines))
        w = energy[:, -1][scored_rows].double()               # Wᵢ = Σₜ mₜρₜ²wₜ (masked positions carry the total)
        p = power[scored_rows].double()
        device = a.device

        def count(x: torch.Tensor) -> torch.Tensor:
            return torch.tensor(float(x.numel()), dtype=torch.float64, device=device)

        def extremes(x: torch.Tensor) -> list[torch.Tensor]:        # (min, −max): one MIN combines both
            if x.numel() == 0:
                return [torch.tensor(math.inf, dtype=torch.float64, device=device)] * 2
            return [x.min(), -x.max()]

        local = torch.stack([count(a), a.sum(), a.square().sum(), g.sum(), b.sum(), count(w), w.sum(), p.sum(),
                             *extremes(a), *extremes(g), *extremes(b), *extremes(w)])
        totals = self.accelerator.gather(local.to(self.accelerator.device)).reshape(-1, local.numel()).cpu()
        _check_finite_advantages(totals)
        tokens, trajectories = totals[:, 0].sum().item(), totals[:, 5].sum().item()
        metrics = self._metrics[mode]
        if tokens > 0:
            mean = totals[:, 1].sum().item() / tokens
            metrics["otb/advantages/mean"].append(mean)
            metrics["otb/advantages/std"].append(math.sqrt(max(totals[:, 2].sum().item() / tokens - mean * mean, 0.0)))
            metrics["otb/advantages/min"].append(totals[:, 8].min().item())
            metrics["otb/advantages/max"].append(-totals[:, 9].min().item())
            metrics["otb/returns/mean"].append(totals[:, 3].sum().item() / tokens)
            metrics["otb/returns/min"].append(totals[:, 10].min().item())
            metrics["otb/returns/max"].append(-totals[:, 11].min().item())
            metrics["otb/baseline/mean"].append(totals[:, 4].sum().item() / tokens)
            metrics["otb/baseline/min"].append(totals[:, 12].min().item())
            metrics["otb/baseline/max"].append(-totals[:, 13].min().item())
        if trajectories > 0:
            metrics["otb/realized_energy/mean"].append(totals[:, 6].sum().item() / trajectories)
            metrics["otb/realized_energy/min"].append(totals[:, 14].min().item())
            metrics["otb/realized_energy/max"].append(-totals[:, 15].min().item())
            metrics["otb/total_power"].append(totals[:, 7].sum().item() / trajectories)
        positions = valid.shape[1]
        first = torch.where(valid, torch.arange(positions, device=valid.device), positions).amin(dim=1)
        leading = batch.advantages.gather(1, first.clamp(max=positions - 1).unsqueeze(1)).squeeze(1)
        leading = torch.where(scored_rows, leading, torch.zeros_like(leading))
        pairs = torch.stack([batch.row_ids.double(), leading.double()], dim=1).to(self.accelerator.device)
        everywhere = self.accelerator.gather(pairs).reshape(-1, 2).cpu()
        ordered = everywhere[torch.argsort(everywhere[:, 0])][:, 1].float().tolist()
        table = self._logs["advantages"]
        for _ in range(min(len(ordered), len(table))):
            table.pop()
        table.extend(ordered)


# ----------------------------------------------------------------------------------------------------------------------
# checks


def _unsharded_head_needed(policy: Any) -> None:
    """Raise where trl 1.16's fused LM head is about to read the policy's head weight as a sharded FSDP2 DTensor over
    several ranks, with gradient: it would train on ``weight.full_tensor()`` (``trl/trainer/utils.py:1633–1639``),
    whose gradient is reduced over no rank — each rank would step its shard of the head with the gradient of its own
    rows alone, silently (docs/trl.md, *FSDP2*; measured by tests/trl_fsdp2_head.py). Called after the backbone's
    forward, just before TRL reads the weight: where the head shares an FSDP2 unit with the final norm (accelerate's
    own layout, ``accelerate/utils/fsdp_utils.py:857–879``), that unit is whole by then and trained as the others."""
    tensors = sys.modules.get("torch.distributed.tensor")
    head = policy.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if (tensors is not None and isinstance(weight, tensors.DTensor) and weight.requires_grad
            and torch.is_grad_enabled() and weight.device_mesh.size() > 1):
        raise ValueError("model: its LM head's weight is still sharded (an FSDP2 DTensor) when trl 1.16's fused LM "
                         "head reads it, which then trains on weight.full_tensor(), whose gradient is not reduced "
                         "over the ranks (each shard would learn from one rank's rows); keep the head in an FSDP2 "
                         "unit that the backbone's forward gathers, as accelerate's own layout does with the final "
                         "norm — a size-based wrap that gives a large head a unit of its own does not (docs/trl.md, "
                         "FSDP2)")


@contextlib.contextmanager
def _unreduced_head_guard(model: Any) -> Any:
    """:func:`_unsharded_head_needed` as a forward hook of the backbone that TRL's fused forward runs before it reads
    the head (its ``backbone_attr``), for the duration of one ``_get_per_token_logps_and_entropies`` call; nothing
    where the policy's forward is not TRL's fused one."""
    policy = model.get_base_model() if hasattr(model, "get_base_model") else model
    closure = _trl_fused_forward_closure(vars(policy).get("forward"))
    backbone = getattr(policy, closure.get("backbone_attr", ""), None) if closure is not None else None
    if not isinstance(backbone, torch.nn.Module):
        yield
        return

    def after_the_backbone(module: Any, args: Any, output: Any) -> None:       # returns None: the output stays
        _unsharded_head_needed(policy)

    handle = backbone.register_forward_hook(after_the_backbone)
    try:
        yield
    finally:
        handle.remove()


def _check_rewards(rewards_per_func: torch.Tensor, names: list[str], weights: torch.Tensor) -> None:
    """±inf from a reward function, or a weighted sum that overflows, raises here, naming the function and the
    completion (its row in the generation batch gathered over the processes, which every process holds alike, so all
    raise) — not later inside OTB, at a row of one process's shuffled batch. NaN (a function's None) marks a
    completion it does not score, as in TRL."""
    infinite = torch.isinf(rewards_per_func)
    if bool(infinite.any()):
        row, column = (int(i) for i in torch.nonzero(infinite)[0])
        raise ValueError(f"reward function {names[column]!r} returned {float(rewards_per_func[row, column])} (in "
                         f"{str(rewards_per_func.dtype).replace('torch.', '')}, TRL's reward dtype) for "
                         f"completion {row} of the generation batch (over all processes): rewards must be finite "
                         "(None marks a completion the function does not score)")
    total = (rewards_per_func * weights.to(rewards_per_func.device).unsqueeze(0)).nansum(dim=1)
    if not bool(torch.isfinite(total).all()):
        row = int(torch.nonzero(~torch.isfinite(total))[0])
        raise ValueError(f"reward_weights: the weighted sum of the rewards of completion {row} of the generation batch "
                         f"overflows float32 ({rewards_per_func[row].tolist()} weighted by {weights.tolist()})")


def _check_finite_advantages(totals: torch.Tensor) -> None:
    """Finite rewards so large that OTB's float32 sums Σᵢ GᵢWᵢ overflow give ±inf or NaN advantages: raise, naming the
    rewards, instead of training on them. ``totals`` [P, 16] are the processes' gathered metrics (token count; the
    advantages', returns' and baselines' (min, −max) at columns 8–13, +inf where a process has no valid token), the
    same on every process, so every process raises alike."""
    scored = totals[:, 0] > 0
    extremes = totals[scored][:, 8:14]
    if bool(torch.isfinite(extremes).all()):
        return
    largest = float(torch.nan_to_num(extremes[:, 2:4].abs(), nan=0.0, posinf=math.inf).max()) if len(extremes) else 0.0
    raise ValueError(f"rewards: finite, but OTB's advantages came out ±inf or NaN — the returns (up to {largest:.3g} "
                     "in magnitude) times the realized energies overflow float32 in the group sums Σᵢ GᵢWᵢ; scale "
                     "the rewards down (reward_weights) so that |G|·ΣW stays far below 3.4e38")


def _check_trl_version() -> None:
    version = getattr(trl, "__version__", "unknown")
    if version.split(".")[:2] != SUPPORTED_TRL_SERIES.split("."):
        raise RuntimeError(
            f"otb_torch.trl supports trl {SUPPORTED_TRL_SERIES}.x and found trl {version}: OTBGRPOTrainer overrides "
            "private GRPOTrainer methods whose behaviour it relies on (docs/trl.md), so another release could train on "
            f"wrong advantages without an error; install trl=={SUPPORTED_TRL_SERIES}.* (pip install \"otb-spec[trl]\")")


_TRAINER_SIGNATURE = inspect.signature(GRPOTrainer.__init__)


def _bind_trainer_arguments(args: tuple, kwargs: dict) -> inspect.BoundArguments:
    unknown = [name for name in kwargs if name not in _TRAINER_SIGNATURE.parameters or name == "self"]
    if unknown:
        raise ValueError(f"{unknown[0]}: not an argument of OTBGRPOTrainer (the arguments of trl.GRPOTrainer, then "
                         f"variant, align, epsilon, handle_zero_tail)")
    try:
        return _TRAINER_SIGNATURE.bind(None, *args, **kwargs)
    except TypeError as exc:
        raise ValueError(f"OTBGRPOTrainer: {exc} (the arguments of trl.GRPOTrainer, then variant, align, epsilon, "
                         "handle_zero_tail)") from exc


def _check_config(config: Any) -> None:
    """Reject the GRPOConfig settings that would distort per-token advantages (docs/trl.md, "Configuration")."""
    if not isinstance(config, trl.GRPOConfig):
        raise ValueError(f"args: expected a trl.GRPOConfig, got {type(config).__name__}")
    if config.scale_rewards != "none":
        raise ValueError(
            f"scale_rewards: OTBGRPOTrainer needs scale_rewards='none' (or False), got {config.scale_rewards!r}"
            + (" (TRL's default; True becomes 'group' too)" if config.scale_rewards == "group" else "") + ". "
            "OTB's advantages are returns minus a per-token baseline, in reward units; TRL's scaling divides them by "
            "the group's (or batch's) reward std + 1e-4, which multiplies the advantages of a zero-std group by 10⁴ "
            "where the baseline is 0 (verl's zero tail, or no other member valid with leave_one_out). Set "
            "GRPOConfig(scale_rewards='none').")
    if config.multi_objective_aggregation != "sum_then_normalize":
        raise ValueError(
            f"multi_objective_aggregation: OTBGRPOTrainer needs 'sum_then_normalize' (the weighted sum of the reward "
            f"functions, unscaled with scale_rewards='none'), got {config.multi_objective_aggregation!r}, which "
            "normalises each reward per group and the sum per batch")
    # the loss type first: a rejected one (LUSPO) would otherwise first send its user to change the importance
    # sampling level it needs
    if config.loss_type in _REJECTED_LOSS_TYPES:
        raise ValueError(f"loss_type: {config.loss_type!r} is not supported by OTBGRPOTrainer: "
                         f"{_REJECTED_LOSS_TYPES[config.loss_type]}; use one of {ACCEPTED_LOSS_TYPES}")
    if config.loss_type not in ACCEPTED_LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {ACCEPTED_LOSS_TYPES}, got {config.loss_type!r}")
    if config.importance_sampling_level != "token":
        raise ValueError(
            f"importance_sampling_level: OTBGRPOTrainer needs 'token', got {config.importance_sampling_level!r}: a "
            "sequence-level ratio (GSPO) carries the gradient of every token of a sequence, so each token would be "
            "weighted by the sequence's mean advantage instead of its own")


def _signature() -> inspect.Signature:
    trainer = list(_TRAINER_SIGNATURE.parameters.values())
    options = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default)
               for name, default in (("variant", "otb"), ("align", "position"), ("epsilon", 1e-8),
                                     ("handle_zero_tail", None))]
    return _TRAINER_SIGNATURE.replace(parameters=trainer + options)


OTBGRPOTrainer.__init__.__signature__ = _signature()  # type: ignore[attr-defined]
