"""Route verl 0.9.1's OTB estimators (and, on request, the actor's Σπ²) to otb_torch — one call.

    import otb_torch.verl
    otb_torch.verl.install()                              # verl's semantics, vectorized
    otb_torch.verl.install(variant="leave_one_out")       # the unbiased leave-one-out OTB, same config names
    otb_torch.verl.install(sum_pi_squared=True)           # in the actor workers: the memory-bounded Σπ² too
    otb_torch.verl.install(v1_trainer=True)               # in verl's v1 trainer (its default): ask for Σπ², use it
    otb_torch.verl.uninstall()                            # every patched place holds verl's own object again

How verl 0.9.1 reaches these functions (line numbers of the installed 0.9.1 files):

* ``verl/trainer/ppo/ray_trainer.py:250`` — ``compute_advantage`` looks the estimator up with
  ``core_algos.get_adv_estimator_fn(adv_estimator)``, which reads ``core_algos.ADV_ESTIMATOR_REGISTRY``
  (``core_algos.py:113, 137–150``). Only for the names ``optimal_token_baseline`` and ``tir_optimal_token_baseline``
  does it pass ``old_log_probs``, ``sum_pi_squared`` and ``rollout_is_weights`` (``ray_trainer.py:265–275``), so an
  estimator under any other name never receives them. :func:`install` therefore replaces the registry entries of
  these two names — for ``variant="leave_one_out"`` too, which then needs no change to the user's config.
* ``register_adv_est(name)(fn)`` refuses a second function for a registered name (``core_algos.py:127–130``); the
  entries are replaced in the dict directly, and restored by :func:`uninstall`.
* Σπ² is computed in the actor when ``actor.calculate_sum_pi_squared=True``, by
  ``verl.utils.torch_functional.calculate_sum_pi_squared_from_logits`` (``torch_functional.py:690``), which the FSDP
  engine calls as a module attribute (``workers/engine/fsdp/transformer_impl.py:1395, 1496``). The Megatron engine
  uses its own vocab-parallel ``vocab_parallel_sum_pi_squared`` (``utils/megatron/tensor_parallel.py:173``); that one
  is not replaced (its logits are sharded over the vocabulary, which the port's function does not all-reduce).
* With fused kernels, ``sum_pi_squared=True`` replaces verl's ``FusedLinearForPPO`` (torch backend) and wraps verl's
  fused model forwards; on FSDP2 with an untied lm_head the port's pass runs as the head's FSDP2 forward method, so
  the weight is gathered and its gradient reduced over the ranks (below ``_HEAD_METHOD``; docs/verl.md, *FSDP2 with
  fused kernels*).

Besides the registry and the defining modules, every loaded ``verl.*`` module attribute that *is* one of verl's
originals (imported by name, under any alias) is replaced too, and modules imported later pick up the replacement
from the defining module. :func:`uninstall` restores every place to verl's own object (``is`` identity), including
by-name imports made while installed.

Where to call it: in the process that runs ``compute_advantage`` — in verl 0.9.1 the ``TaskRunner`` Ray actor, not
the shell's ``python`` process — and, for Σπ², in the actor workers. A Ray worker setup hook reaches both:
:func:`install_from_environment` (docs/verl.md has the command line). This module imports without verl; :func:`install`
names the missing package when verl (or one of its imports) is not installed.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import inspect
import os
import re
import sys
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

import otb_torch
from otb_spec import _validation as reference_checks
from otb_torch import _checks, _otb
from otb_torch._otb import leave_one_out_advantages

__all__ = [
    "VARIANTS",
    "ESTIMATOR_NAMES",
    "TESTED_VERL_VERSION",
    "Installation",
    "install",
    "uninstall",
    "installed",
    "install_from_environment",
    "compute_leave_one_out_token_baseline_advantage",
    "compute_multi_turn_leave_one_out_token_baseline_advantage",
]

VARIANTS = ("verl", "leave_one_out")
"""``"verl"``: verl's self-inclusive OTB (the drop-ins, same results within float tolerance).
``"leave_one_out"``: member i's baseline from the other members only — unbiased (proofs/T3)."""

ESTIMATOR_NAMES = ("optimal_token_baseline", "tir_optimal_token_baseline")
"""verl's ``algorithm.adv_estimator`` values that :func:`install` routes: single-turn and multi-turn (TIR) OTB."""

TESTED_VERL_VERSION = "0.9.1"

_CORE_ALGOS = "verl.trainer.ppo.core_algos"
_TORCH_FUNCTIONAL = "verl.utils.torch_functional"
_REGISTRY = "ADV_ESTIMATOR_REGISTRY"
# registry name → the name of verl's function in core_algos (core_algos.py:871–872, 990–991)
_VERL_FUNCTIONS = {
    "optimal_token_baseline": "compute_optimal_token_baseline_advantage",
    "tir_optimal_token_baseline": "compute_multi_turn_optimal_token_baseline_advantage",
}
_SUM_PI_SQUARED = "calculate_sum_pi_squared_from_logits"
# the fused-kernel route (install(sum_pi_squared=True)): verl's torch fused backend, its model forwards, the FSDP engine
_EXPERIMENTAL_FUNCTIONAL = "verl.utils.experimental.torch_functional"
_FUSED_LINEAR = "FusedLinearForPPO"
_FUSED_FORWARD_MODULES = ("verl.models.transformers.dense_common", "verl.models.transformers.qwen2_vl",
                          "verl.models.transformers.qwen3_vl", "verl.models.transformers.glm4v",
                          "verl.models.transformers.qwen3_5")
_FUSED_FORWARD = "forward_with_torch_backend"
_FSDP_ENGINE = "verl.workers.engine.fsdp.transformer_impl"
_FSDP_ACTOR_ENGINE = "FSDPEngineWithLMHead"
_PREPARE_OUTPUTS = "prepare_model_outputs"
_FUSED_REFUSAL = (
    "calculate_sum_pi_squared=True with use_fused_kernels=True: this fused forward did not return Σπ². otb_torch "
    "supplies it from verl's torch fused backend: set actor_rollout_ref.model.fused_kernel_options.impl_backend=torch "
    "and call otb_torch.verl.install(sum_pi_squared=True) in the actor workers before the model is built (the Ray "
    "worker setup hook otb_torch.verl.install_from_environment with OTB_VERL_SUM_PI_SQUARED=yes does; docs/verl.md). "
    "Otherwise set actor_rollout_ref.model.use_fused_kernels=False.")
_INSTALL_HINT = ('install verl 0.9.1 and what its advantage code imports: pip install "otb-spec[verl]" && '
                 "pip install --no-deps verl==0.9.1 torchdata==0.11.0 torchtitan==0.3.0")


# ----------------------------------------------------------------------------------------------------------------------
# leave-one-out OTB with verl's signature


def _leave_one_out(align: str, token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any,
                   old_log_probs: torch.Tensor, sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None,
                   handle_zero_tail: bool, epsilon: float, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    reference_checks.flag("handle_zero_tail", handle_zero_tail)     # accepted for verl's signature; implied (below)
    check_values = reference_checks.flag("check_values", kwargs.pop("check_values", True))
    compile = reference_checks.flag("compile", kwargs.pop("compile", False))
    return leave_one_out_advantages(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                                    rollout_is_weights, align=align, epsilon=epsilon, check_values=check_values,
                                    compile=compile, names=_otb._VERL_NAMES)


def compute_leave_one_out_token_baseline_advantage(
        token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any, old_log_probs: torch.Tensor,
        sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None = None, handle_zero_tail: bool = True,
        epsilon: float = 1e-8, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out OTB with verl's signature (single-turn, position-aligned): returns (advantages, returns).

    For member i of a prompt group, at position t:

        Bₜ⁽ⁱ⁾ = Σ_{j≠i} Gₜʲ Wₜʲ mₜʲ / (Σ_{j≠i} Wₜʲ mₜʲ + ε),    Aₜ⁽ⁱ⁾ = (Gₜ⁽ⁱ⁾ − Bₜ⁽ⁱ⁾)·mₜ⁽ⁱ⁾

    with Gₜ = Σ_{k≥t} mₖrₖ, Wₜ = Σ_{j≤t} mⱼρⱼ²(1 − 2πⱼ + Σπ²ⱼ) (ρ: ``rollout_is_weights``, 1 when None). Bₜ⁽ⁱ⁾ does
    not depend on trajectory i, so E[∇log π⁽ⁱ⁾·Bₜ⁽ⁱ⁾] = 0: the gradient is unbiased (proofs/T3), unlike verl's
    self-inclusive OTB. Where no other member is valid at t, Bₜ⁽ⁱ⁾ = 0 — which is what verl's zero tail does on right
    padding, so ``handle_zero_tail`` (accepted for verl's signature, must be a bool) has nothing left to do; also where
    the others' energy Σ_{j≠i} Wₜʲmₜʲ ≤ 0. Each W is read as max(W, 0), so every baseline stays a weighted mean of
    the other members' returns (up to rounding) even where a bf16 Σπ² below π² makes energies negative (proofs/N1
    item 5).
    ``index``: verl's NumPy array of uids (any hashable ids) or :class:`otb_torch.Segments`. Extra keywords that verl
    passes (``config``, ``reward_baselines``) are ignored; ``check_values`` and ``compile`` are otb_torch's options.
    """
    return _leave_one_out("position", token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                          rollout_is_weights, handle_zero_tail, epsilon, kwargs)


def compute_multi_turn_leave_one_out_token_baseline_advantage(
        token_level_rewards: torch.Tensor, response_mask: torch.Tensor, index: Any, old_log_probs: torch.Tensor,
        sum_pi_squared: torch.Tensor, rollout_is_weights: torch.Tensor | None = None, handle_zero_tail: bool = True,
        epsilon: float = 1e-8, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Leave-one-out OTB with verl's signature, aligned on valid tokens (multi-turn masks with holes where tool output
    was): the k-th valid token of member i is compared with the k-th valid tokens of the others, as verl's
    ``compute_multi_turn_optimal_token_baseline_advantage`` does. Otherwise as
    :func:`compute_leave_one_out_token_baseline_advantage`.
    """
    return _leave_one_out("valid_token", token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared,
                          rollout_is_weights, handle_zero_tail, epsilon, kwargs)


_ESTIMATORS = {
    "verl": {"optimal_token_baseline": otb_torch.compute_optimal_token_baseline_advantage,
             "tir_optimal_token_baseline": otb_torch.compute_multi_turn_optimal_token_baseline_advantage},
    "leave_one_out": {"optimal_token_baseline": compute_leave_one_out_token_baseline_advantage,
                      "tir_optimal_token_baseline": compute_multi_turn_leave_one_out_token_baseline_advantage},
}


def _with_options(function: Callable, options: dict, label: str) -> Callable:
    """``function`` with otb_torch's options bound as keyword defaults (an explicit keyword of the caller wins), and
    with the value checks adapted to a Σπ² rounded to half precision (:func:`_rounded_to_half_precision`)."""
    signature = inspect.signature(function)
    estimator = {"sum_pi_squared", "response_mask"} <= set(signature.parameters)    # not the Σπ² function

    @functools.wraps(function)
    def bound(*args: Any, **kwargs: Any) -> Any:
        merged = {**options, **kwargs}
        if estimator and merged.get("check_values") is True:
            try:
                call = signature.bind(*args, **merged).arguments
            except TypeError:
                call = None                                    # the function's own call raises the error
            rounded = None if call is None else _rounded_to_half_precision(call)
            if rounded is not None:
                _check_values_without_consistency(call, rounded)
                merged["check_values"] = False
        return function(*args, **merged)

    bound.__qualname__ = f"{function.__qualname__}[{label}]"
    return bound


_HALF_PRECISION_WARNED = False

# the estimators' tensor arguments, by verl's names, which their errors give them under both variants
_TENSORS = ("token_level_rewards", "response_mask", "old_log_probs", "sum_pi_squared", "rollout_is_weights")


def _rounded_to_half_precision(call: dict) -> str | None:
    """The half precision an estimator call's ``sum_pi_squared`` was rounded to, or None: bfloat16 or float16
    tensors, and float32 or float64 ones whose values at valid positions all survive a round trip through bfloat16
    (float16) — what verl's trainer passes (``.float()`` of the actor's Σπ², ray_trainer.py:1322) after a bf16
    (fp16) forward. None too where the call's tensors do not all have the mask's shape: the estimator's own shape
    checks then name what is wrong. A strided sample is tried first, so a Σπ² that is not rounded rarely costs a
    pass over it; a rounded one always does.

    verl's actor computes that Σπ² as exp(lse(2z) − 2·lse(z)) in the logits' precision: tens of percent off where
    the softmax is peaked (measured on bfloat16 logits ~N(0, 8²), V = 32768: up to 59 %, π² above Σπ² by up to 0.17,
    14 % of tokens beyond the check's float32 slack), far beyond the slack of the rule Σπ² ≥ π² — which exists to
    catch statistics taken from different forward passes or shifted by one, and cannot tell them from this error."""
    sum_pi_squared, response_mask = call["sum_pi_squared"], call["response_mask"]
    tensors = [call[name] for name in _TENSORS if call.get(name) is not None]
    if not isinstance(response_mask, torch.Tensor) or not all(
            isinstance(value, torch.Tensor) and value.shape == response_mask.shape for value in tensors):
        return None
    if not sum_pi_squared.is_floating_point():
        return None
    if sum_pi_squared.dtype in (torch.bfloat16, torch.float16):
        return str(sum_pi_squared.dtype).replace("torch.", "")
    values, mask = sum_pi_squared.detach().reshape(-1), response_mask.detach().reshape(-1)
    sample = max(1, values.numel() // _ROUND_TRIP_SAMPLE)
    for half in (torch.bfloat16, torch.float16):
        if _round_trip_fails(values[::sample], mask[::sample], half, values.numel()):    # settled by a sample
            continue
        fails = _round_trip_fails(values, mask, half, _ROUND_TRIP_CHUNK if values.device.type == "cpu" else None)
        if fails is None:                                                # no valid position
            return None
        if not fails:
            # only 0s and 1s (a policy sure of every token) survive any rounding: nothing says they were rounded,
            # and π² ≤ Σπ² ∈ {0, 1} needs no exemption
            informative = (values != 0) & (values != 1) & (mask != 0)
            return str(half).replace("torch.", "") if bool(informative.any()) else None
    return None


_ROUND_TRIP_SAMPLE = 4096         # values tried first, evenly strided: a valid one that does not survive settles it
_ROUND_TRIP_CHUNK = 2**18         # values per step of the whole test on the CPU (its temporaries stay in cache)


def _round_trip_fails(values: torch.Tensor, mask: torch.Tensor, half: torch.dtype, step: int | None) -> bool | None:
    """Whether some value of ``values`` (flat) where the flat ``mask`` ≠ 0 changes in a round trip through ``half``
    (NaN counts as changed); None where the mask has no nonzero value. In steps of ``step`` values (None: at once),
    one synchronisation each, stopping at the first step that settles it."""
    valid_seen = False
    step = max(1, values.numel() if step is None else step)                  # no values: no valid position
    for start in range(0, values.numel(), step):
        x, valid = values[start:start + step], mask[start:start + step] != 0
        changed, any_valid = torch.stack([((x.to(half).to(x.dtype) != x) & valid).any(), valid.any()]).tolist()
        if changed:
            return True
        valid_seen |= any_valid
    return None if not valid_seen else False


def _check_values_without_consistency(call: dict, rounded: str) -> None:
    """The value checks of an estimator's inputs (``call``: argument → value, verl's names) that the kernel path runs
    (``otb_torch._checks.check_values``: one synchronisation; the reference's error, naming the argument by verl's
    name), all but Σπ² ≥ π²; a warning once per process that the rule is left out, Σπ² being ``rounded`` to half
    precision (:func:`_rounded_to_half_precision`)."""
    global _HALF_PRECISION_WARNED
    weights = call.get("rollout_is_weights")
    _checks.check_values(
        True, rewards=("token_level_rewards", call["token_level_rewards"]),
        mask=("response_mask", call["response_mask"]),
        log_probs=("old_log_probs", call["old_log_probs"]),
        sum_pi_squared=("sum_pi_squared", call["sum_pi_squared"]),
        is_weights=None if weights is None else ("rollout_is_weights", weights), consistency=False)
    if not _HALF_PRECISION_WARNED:
        _HALF_PRECISION_WARNED = True
        warnings.warn(
            f"otb_torch.verl: sum_pi_squared arrives rounded to {rounded} "
            "— verl's actor computes it from half-precision logits as exp(lse(2z) − 2·lse(z)) in that precision, "
            "tens of percent off where the softmax is peaked — so the check Σπ² ≥ π² (statistics from different "
            "passes or shifted by one) is left out for such inputs; every other value check still runs. "
            "install(sum_pi_squared=True) in the actor workers makes Σπ² accurate (docs/verl.md); it still arrives "
            "rounded, so the rule stays off.", RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------------------------------------------------------
# Σπ² from verl's fused torch backend (install(sum_pi_squared=True))

_COLLECTING = threading.local()


@contextlib.contextmanager
def _pushed(local: threading.local, item: Any) -> Iterator[Any]:
    """``item`` on top of this thread's ``local.stack`` inside the block (nested blocks push their own)."""
    stack = getattr(local, "stack", None)
    if stack is None:
        stack = local.stack = []
    stack.append(item)
    try:
        yield item
    finally:
        stack.pop()


def _top(local: threading.local) -> Any:
    """The item on top of this thread's ``local.stack``; None outside every block."""
    stack = getattr(local, "stack", None)
    return stack[-1] if stack else None


def _collecting_sum_pi_squared() -> contextlib.AbstractContextManager[list]:
    """Collect the Σπ² of every fused pass that runs in this thread inside the block (nested blocks each get their
    own list)."""
    return _pushed(_COLLECTING, [])


def _hand_over_sum_pi_squared(value: torch.Tensor) -> None:
    collected = _top(_COLLECTING)
    if collected is not None:
        collected.append(value)


def _logits_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype verl's ``hidden_states @ vocab_weights.t()`` has: the autocast dtype under autocast (verl's
    ``forward_step`` runs the model under ``torch.autocast`` unless the param dtype is float32), else the inputs'."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.is_floating_point():
        return torch.get_autocast_dtype(device)
    return torch.promote_types(hidden.dtype, weight.dtype)


_VERL_FUSED_ARGUMENTS = {"hidden": "hidden_states", "weight": "vocab_weights", "token_ids": "input_ids"}


def _in_verls_names(exc: Exception) -> Exception:
    """The same error, naming the argument as verl's ``FusedLinearForPPO.forward`` calls it (hidden_states,
    vocab_weights, input_ids) where otb_torch's message names its own (hidden, weight, token_ids)."""
    message = str(exc)
    name, colon, rest = message.partition(": ")
    if not colon or name not in _VERL_FUSED_ARGUMENTS:
        return exc
    for own, verls in _VERL_FUSED_ARGUMENTS.items():     # "H = hidden.shape[-1]", "… but hidden is on …"
        rest = re.sub(rf"(?<!the )\b{own}\b(?=[ .])", verls, rest)
    return type(exc)(f"{_VERL_FUSED_ARGUMENTS[name]}: {rest}")


def _fused_linear_class(verl_class: type, check_values: bool) -> type:
    """A subclass of verl's ``FusedLinearForPPO`` whose torch backend is :func:`otb_torch.fused_linear_token_statistics`."""

    class FusedLinearForPPOWithSumPiSquared(verl_class):
        """verl's ``FusedLinearForPPO`` with otb_torch's torch backend: the same (log π, entropy) — log π in float32,
        the entropy in the logits' dtype, as verl returns them, with exact gradients — computed without
        materialising the logits, and Σπ² from the same pass, handed to the enclosing model forward (which attaches
        it to its output as ``sum_pi_squared``). The Liger backend, when installed and chosen, runs unchanged and
        gives no Σπ²."""

        def forward(self, hidden_states: torch.Tensor, vocab_weights: torch.Tensor, input_ids: torch.Tensor,
                    temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
            functional = sys.modules.get(_EXPERIMENTAL_FUNCTIONAL)
            liger = getattr(functional, "_LIGER_FUSED_LINEAR_SCALED_CROSS_ENTROPY", None)
            if self.impl_backend != "torch" and liger is not None:
                return super().forward(hidden_states, vocab_weights, input_ids, temperature)
            try:
                head = _sharded_head(vocab_weights)
                if head is None:
                    log_probs, entropy, sum_pi_squared = _verls_token_statistics(
                        hidden_states, vocab_weights, input_ids, temperature, check_values)
                else:                 # FSDP2 all-gathers the head's weight around this call, and reduces its gradient
                    log_probs, entropy, sum_pi_squared = getattr(head, _HEAD_METHOD)(
                        hidden_states, input_ids, temperature=temperature, check_values=check_values)
            except (TypeError, ValueError) as exc:
                raise _in_verls_names(exc) from exc
            _hand_over_sum_pi_squared(sum_pi_squared)
            return log_probs, entropy

    FusedLinearForPPOWithSumPiSquared.__qualname__ = f"otb_torch.verl.{FusedLinearForPPOWithSumPiSquared.__name__}"
    return FusedLinearForPPOWithSumPiSquared


def _verls_token_statistics(hidden: torch.Tensor, weight: torch.Tensor, token_ids: torch.Tensor, temperature: Any,
                            check_values: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """log π (float32), entropy (in the dtype of verl's logits) and Σπ² of softmax(h·Wᵀ/τ), as verl's
    ``FusedLinearForPPO`` returns the first two, from otb_torch's fused kernel."""
    statistics = otb_torch.fused_linear_token_statistics(hidden, weight, token_ids, temperature=temperature,
                                                         check_values=check_values)
    return (statistics.log_probs.to(torch.float32), statistics.entropy.to(_logits_dtype(hidden, weight)),
            statistics.sum_pi_squared)


# FSDP2 (verl's strategy "fsdp2") wraps an untied lm_head in a fully_shard unit of its own (verl's
# _select_fsdp2_wrap_targets). Its weight is then a sharded DTensor outside the head's own forward, and verl's fused
# model forwards, which read ``self.lm_head.weight`` without calling the head, hand the fused pass that shard (verl's
# own torch backend fails there: "mixed torch.Tensor and DTensor") or, for Qwen3-VL and Qwen3.5, ``full_tensor()`` of
# it (whose gradient no rank reduces). The port's pass runs as a forward method of the head instead
# (torch.distributed.fsdp.register_fsdp_forward_method): FSDP2 all-gathers the weight in its param dtype before it,
# reshards after it, and reduce-scatters the weight's gradient over the data-parallel ranks after the backward pass,
# as for the head's own forward. Peak extra memory: the head's unsharded weight, as its own forward needs, and copies
# of the per-token outputs that are views (3 values per token).
_HEAD_METHOD = "_otb_torch_fused_token_statistics"
_HEADS = threading.local()          # .stack: the lm_head of each fused model forward running in this thread
_REGISTERED_HEADS: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()    # heads given the method; uninstall()


def _head_token_statistics(head: torch.nn.Module, hidden: torch.Tensor, token_ids: torch.Tensor, *,
                           temperature: Any, check_values: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pass on the head's unsharded weight. Outputs that are views are copied (3 values per token): FSDP2 hooks
    the backward pass on a forward method's outputs, which an in-place op on a view would drop."""
    statistics = _verls_token_statistics(hidden, head.weight, token_ids, temperature, check_values)
    return tuple(value.clone() if value._is_view() else value for value in statistics)


def _sharded_head(weight: Any) -> torch.nn.Module | None:
    """The running model's FSDP2 lm_head, with the port's pass registered as its forward method, when its weight is
    sharded now (outside the head's own forward) and ``weight`` is that DTensor — or a plain tensor of its shape:
    verl's Qwen3-VL and Qwen3.5 forwards (qwen3_vl.py:369–371, qwen3_5.py:587–589) hand the pass
    ``weight.full_tensor()``, whose gradient no rank reduces over the others (each would step its shard with the
    gradient of its own rows alone), so the pass runs on the head's gathered weight instead and that copy is left unused.
    None otherwise (the plain path). A DTensor that is not the weight of the running model's FSDP2 head raises."""
    tensor_module = sys.modules.get("torch.distributed.tensor")
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if tensor_module is None or fsdp is None:
        return None
    head = _top(_HEADS)
    sharded = isinstance(weight, tensor_module.DTensor)
    if isinstance(head, fsdp.FSDPModule) and isinstance(getattr(head, "weight", None), tensor_module.DTensor) and (
            head.weight is weight or (not sharded and tuple(weight.shape) == tuple(head.weight.shape))):
        if _HEAD_METHOD not in head.__dict__:
            setattr(head, _HEAD_METHOD, functools.partial(_head_token_statistics, head))
            fsdp.register_fsdp_forward_method(head, _HEAD_METHOD)
            _REGISTERED_HEADS.add(head)
        return head
    if sharded:
        raise ValueError("weight: a sharded DTensor that is not the weight of an FSDP2 lm_head of the model running "
                         "this forward; otb_torch's fused pass needs the whole [V, H] weight (gather it, or wrap "
                         "the head with torch.distributed.fsdp.fully_shard)")
    return None


def _running_head(model: Any) -> contextlib.AbstractContextManager[Any]:
    """The model's lm_head as the running one in this thread inside the block (what :func:`_sharded_head` reads)."""
    return _pushed(_HEADS, getattr(model, "lm_head", None))


def _forward_with_sum_pi_squared(verl_forward: Callable) -> Callable:
    """verl's fused model forward (``forward_with_torch_backend``), with the Σπ² of its fused pass attached to the
    output as the attribute ``sum_pi_squared`` (shaped like ``log_probs``) when exactly one pass ran; an FSDP2 lm_head
    of the model all-gathers its weight around the pass (above)."""

    @functools.wraps(verl_forward)
    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _collecting_sum_pi_squared() as collected, _running_head(self):
            output = verl_forward(self, *args, **kwargs)
        log_probs = getattr(output, "log_probs", None)
        if len(collected) == 1 and log_probs is not None:
            output.sum_pi_squared = collected[0].reshape(log_probs.shape)
        return output

    forward.__qualname__ = f"{verl_forward.__qualname__}[otb_torch.verl: + sum_pi_squared]"
    return forward


def _prepare_model_outputs_with_sum_pi_squared(verl_method: Callable) -> Callable:
    """``FSDPEngineWithLMHead.prepare_model_outputs`` that accepts ``calculate_sum_pi_squared`` with fused kernels
    when the fused forward supplied Σπ², and returns it as verl returns its entropy (unpadded, one nested row per
    sequence); without Σπ² from the forward, it refuses with a message saying what to do."""

    @functools.wraps(verl_method)
    def prepare_model_outputs(self: Any, output: Any, output_args: dict, micro_batch: Any,
                              logits_processor_func: Any) -> dict:
        tu = sys.modules["verl.utils.tensordict_utils"]
        wanted = tu.get_non_tensor_data(data=micro_batch, key="calculate_sum_pi_squared", default=False)
        fused = tu.get_non_tensor_data(data=micro_batch, key="use_fused_kernels", default=False)
        if not (wanted and fused):
            return verl_method(self, output, output_args, micro_batch, logits_processor_func)
        supplied = getattr(output, "sum_pi_squared", None)
        if supplied is None:
            raise NotImplementedError(_FUSED_REFUSAL)
        tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=False)
        try:
            model_output = verl_method(self, output, output_args, micro_batch, logits_processor_func)
        finally:
            tu.assign_non_tensor(micro_batch, calculate_sum_pi_squared=True)
        offsets = micro_batch["input_ids"].offsets()
        if tu.get_non_tensor_data(data=micro_batch, key="use_remove_padding", default=True):
            values = self._gather_and_unpad_packed(supplied.squeeze(0), output_args["pad_size"])
        else:                                           # dense [bsz, seqlen]: keep each sequence's valid columns
            lengths = offsets.diff()
            valid = torch.arange(supplied.shape[1], device=supplied.device) < lengths.unsqueeze(1)
            values = supplied[valid]
        model_output["sum_pi_squared"] = torch.nested.nested_tensor_from_jagged(values, offsets)
        return model_output

    prepare_model_outputs.__qualname__ = f"{verl_method.__qualname__}[otb_torch.verl: + fused sum_pi_squared]"
    return prepare_model_outputs


@dataclass(frozen=True)
class _ClassPatch:
    """``owner.attribute`` is ``replacement`` while installed, verl's ``original`` otherwise."""

    owner: type
    attribute: str
    original: Any
    replacement: Any


def _loaded_subclasses(root: type) -> list[type]:
    seen: dict[int, type] = {}
    pending = [root]
    while pending:
        for child in pending.pop().__subclasses__():
            if id(child) not in seen:
                seen[id(child)] = child
                pending.append(child)
    return list(seen.values())


def _fused_route(check_values: bool) -> tuple[list[_Replacement], list[_ClassPatch], list[str]]:
    """The replacements of the fused-kernel route: verl's FusedLinearForPPO, its fused model forwards (module
    attributes, and model classes verl already patched), the FSDP actor engine's prepare_model_outputs; and the
    places that could not be patched here, with the reason."""
    replacements: list[_Replacement] = []
    patches: list[_ClassPatch] = []
    unavailable: list[str] = []
    functional = _import_verl(_EXPERIMENTAL_FUNCTIONAL)
    verl_class = getattr(functional, _FUSED_LINEAR)
    replacements.append(_Replacement(verl_class, _fused_linear_class(verl_class, check_values), _FUSED_LINEAR))
    forwards: dict[int, tuple[Callable, Callable]] = {}
    for module_name in _FUSED_FORWARD_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            unavailable.append(f"{module_name}.{_FUSED_FORWARD}: cannot be imported here ({exc})")
            continue
        original = getattr(module, _FUSED_FORWARD)
        wrapped = _forward_with_sum_pi_squared(original)
        forwards[id(original)] = (original, wrapped)
        replacements.append(_Replacement(original, wrapped, _FUSED_FORWARD))
    transformers = sys.modules.get("transformers")
    if transformers is not None:                     # model classes verl's apply_monkey_patch already patched
        for model_class in _loaded_subclasses(transformers.PreTrainedModel):
            current = model_class.__dict__.get("forward")
            pair = forwards.get(id(current))
            if pair is not None and current is pair[0]:
                patches.append(_ClassPatch(model_class, "forward", pair[0], pair[1]))
    try:
        engine_module = importlib.import_module(_FSDP_ENGINE)
    except ImportError as exc:
        unavailable.append(f"{_FSDP_ENGINE}.{_FSDP_ACTOR_ENGINE}.{_PREPARE_OUTPUTS}: cannot be imported here ({exc})")
    else:
        engine = getattr(engine_module, _FSDP_ACTOR_ENGINE)
        original = engine.__dict__[_PREPARE_OUTPUTS]
        patches.append(_ClassPatch(engine, _PREPARE_OUTPUTS, original,
                                   _prepare_model_outputs_with_sum_pi_squared(original)))
    return replacements, patches, unavailable


# ----------------------------------------------------------------------------------------------------------------------
# verl's v1 trainer (trainer.use_v1=True, verl 0.9.1's default): ask the actor for Σπ² and hand it to the advantage step


_V1_TRAINER = "verl.trainer.ppo.v1.trainer_base"
_V1_CLASS = "PPOTrainer"
_V1_OLD_LOG_PROB = "_compute_old_log_prob"
_V1_ADVANTAGE = "_compute_advantage"
_V1_ADVANTAGE_FUNCTION = "compute_advantage_for_multi_trajectories"
_V1_METRICS = "_compute_metrics"
_V1_PROXY_FUNCTION = "compute_variance_proxy_metrics"
_V1_SUM_PI_SQUARED = "sum_pi_squared"
_V1_PROXY_INPUTS = (_V1_SUM_PI_SQUARED, "old_log_probs")
_V1_FLAG = "calculate_sum_pi_squared"
_V1_HANDOVER = threading.local()   # .value: the advantage step's Σπ², padded; .metrics_batch: the metrics step's batch
# trainer → whether its last advantage step stored rollout IS weights (the batch fit() gives the metrics step does not
# list its fields: trainer_base.py:560)
_V1_STORED_WEIGHTS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _v1_otb_estimator(config: Any) -> bool:
    estimator = config.algorithm.adv_estimator
    return getattr(estimator, "value", estimator) in ESTIMATOR_NAMES     # a name, or verl's AdvantageEstimator


def _v1_bypass_mode(config: Any) -> bool:
    """Rollout correction's bypass mode: old log π are the rollout's, no actor forward (trainer_base.py:1641–1648)."""
    correction = config.algorithm.get("rollout_correction", None)
    return bool(correction and correction.get("bypass_mode", False))


def _v1_asks_sum_pi_squared(config: Any) -> bool:
    """The legacy trainer's rule (ray_trainer.py:1297) — Σπ² where the actor config asks for it — for the OTB
    estimators (nothing else in the v1 trainer reads it)."""
    return bool(config.actor_rollout_ref.actor.get(_V1_FLAG, False)) and _v1_otb_estimator(config)


def _v1_wants_sum_pi_squared(config: Any) -> bool:
    """Σπ² asked for, and the actor's forward runs (not in bypass mode)."""
    return _v1_asks_sum_pi_squared(config) and not _v1_bypass_mode(config)


def _v1_old_log_prob_with_sum_pi_squared(verl_method: Callable) -> Callable:
    """verl's ``PPOTrainer._compute_old_log_prob`` that also asks the actor for Σπ², as the legacy trainer's does, and
    stores it in TransferQueue under ``sum_pi_squared``: float32, one value per response position (the worker's
    output over the whole sequence, shifted as verl shifts log π: ``response_from_nested``)."""

    @functools.wraps(verl_method)
    def _compute_old_log_prob(self: Any, batch: Any, metrics: dict) -> Any:
        if not _v1_wants_sum_pi_squared(self.config):
            return verl_method(self, batch, metrics)
        import transfer_queue as tq
        from verl.workers.utils.padding import response_from_nested

        asked = batch
        asked.extra_info[_V1_FLAG] = True
        try:
            batch = verl_method(self, asked, metrics)
        finally:                                   # the later stages (reference, actor update) must not compute it
            asked.extra_info.pop(_V1_FLAG, None)
        batch.extra_info.pop(_V1_FLAG, None)
        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                               select_fields=[_V1_SUM_PI_SQUARED, "response_mask"])
        data[_V1_SUM_PI_SQUARED] = response_from_nested(data.pop(_V1_SUM_PI_SQUARED), data["response_mask"]).float()
        return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                               fields=data.select(_V1_SUM_PI_SQUARED))

    _compute_old_log_prob.__qualname__ = f"{verl_method.__qualname__}[otb_torch.verl: + sum_pi_squared]"
    return _compute_old_log_prob


def _v1_advantage_with_sum_pi_squared(verl_method: Callable) -> Callable:
    """verl's ``PPOTrainer._compute_advantage`` that, for the OTB estimators, reads Σπ² from TransferQueue with the
    other fields and hands it, padded as verl pads them, to ``compute_advantage_for_multi_trajectories``."""

    @functools.wraps(verl_method)
    def _compute_advantage(self: Any, batch: Any, metrics: dict) -> Any:
        if _v1_asks_sum_pi_squared(self.config) and _v1_bypass_mode(self.config):
            raise ValueError("algorithm.rollout_correction.bypass_mode=True: OTB needs Σπ² from the actor's forward "
                             "of the old log π, which bypass mode skips (it takes the rollout's log π); set "
                             "bypass_mode=False to use OTB (otb_torch.verl, v1 trainer)")
        if not _v1_wants_sum_pi_squared(self.config):
            return verl_method(self, batch, metrics)      # verl's own assertion names the missing setting
        import transfer_queue as tq

        data = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id, select_fields=[_V1_SUM_PI_SQUARED])
        _V1_HANDOVER.value = data[_V1_SUM_PI_SQUARED].to_padded_tensor(0.0)
        try:
            batch = verl_method(self, batch, metrics)
        finally:
            _V1_HANDOVER.value = None
        _V1_STORED_WEIGHTS[self] = "rollout_is_weights" in (getattr(batch, "fields", None) or [])
        return batch

    _compute_advantage.__qualname__ = f"{verl_method.__qualname__}[otb_torch.verl: + sum_pi_squared]"
    return _compute_advantage


def _v1_advantage_function(verl_function: Callable) -> Callable:
    """verl's ``compute_advantage_for_multi_trajectories`` with the Σπ² of the patched ``_compute_advantage`` put in
    the batch first (unchanged elsewhere)."""

    @functools.wraps(verl_function)
    def compute_advantage_for_multi_trajectories(data: Any, *args: Any, **kwargs: Any) -> Any:
        sum_pi_squared = getattr(_V1_HANDOVER, "value", None)
        if sum_pi_squared is not None and _V1_SUM_PI_SQUARED not in data.batch.keys():
            _V1_HANDOVER.value = None
            mask = data.batch["response_mask"]
            if sum_pi_squared.shape != mask.shape:
                raise RuntimeError(f"otb_torch.verl: the sum_pi_squared read from TransferQueue has shape "
                                   f"{tuple(sum_pi_squared.shape)}, the batch's response_mask {tuple(mask.shape)}: "
                                   "verl's v1 trainer changed how it pads the batch; this verl is not supported")
            data.batch[_V1_SUM_PI_SQUARED] = sum_pi_squared.to(mask.device)
        return verl_function(data, *args, **kwargs)

    compute_advantage_for_multi_trajectories.__qualname__ = (f"{verl_function.__qualname__}"
                                                             "[otb_torch.verl: + sum_pi_squared]")
    return compute_advantage_for_multi_trajectories


def _v1_metrics_with_sum_pi_squared(verl_method: Callable) -> Callable:
    """verl's ``PPOTrainer._compute_metrics``, whose batch for ``compute_variance_proxy_metrics`` lacks Σπ² and old
    log π (trainer_base.py:1871–1881), with the batch's TransferQueue keys handed to the patched function below."""

    @functools.wraps(verl_method)
    def _compute_metrics(self: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
        if not _v1_wants_sum_pi_squared(self.config):
            return verl_method(self, batch, *args, **kwargs)
        _V1_HANDOVER.metrics_batch = (batch, _V1_STORED_WEIGHTS.get(self, False))
        try:
            return verl_method(self, batch, *args, **kwargs)
        finally:
            _V1_HANDOVER.metrics_batch = None

    _compute_metrics.__qualname__ = f"{verl_method.__qualname__}[otb_torch.verl: + sum_pi_squared]"
    return _compute_metrics


def _v1_proxy_function(verl_function: Callable) -> Callable:
    """verl's ``compute_variance_proxy_metrics`` given Σπ², old log π (and ρ where verl stored it) of the metrics
    batch's rows, read from TransferQueue as the legacy trainer's batch holds them (ray_trainer.py:1322) — so the
    ``variance_proxy/*`` metrics are logged as there. Rows are the batch's non-padding rows, in its order."""

    @functools.wraps(verl_function)
    def compute_variance_proxy_metrics(batch: Any, *args: Any, **kwargs: Any) -> Any:
        handed = getattr(_V1_HANDOVER, "metrics_batch", None)
        if handed is None or _V1_SUM_PI_SQUARED in batch.batch.keys():
            return verl_function(batch, *args, **kwargs)
        _V1_HANDOVER.metrics_batch = None
        meta, weights_stored = handed
        names = list(_V1_PROXY_INPUTS) + (["rollout_is_weights"] if weights_stored else [])
        try:                     # metrics only: whatever goes wrong here must not stop a run verl alone would finish
            import transfer_queue as tq

            fetched = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id, select_fields=names)
            fetched = fetched.to_padded_tensor()
            kept = torch.tensor([not tag.get("is_padding", False) for tag in meta.tags], dtype=torch.bool)
            if kept.any():                                               # verl's metrics_batch (trainer_base.py:1919)
                fetched = fetched[kept]
            mask = batch.batch["response_mask"]
            extra = {name: fetched[name] for name in names}
            if any(value.shape != mask.shape for value in extra.values()):
                raise ValueError(f"shapes {[tuple(value.shape) for value in extra.values()]}, the metrics batch's "
                                 f"response_mask {tuple(mask.shape)}")
            completed = batch.batch.copy()
            for name, value in extra.items():
                completed[name] = value.to(mask.device)
            batch = type(batch)(batch=completed, non_tensor_batch=batch.non_tensor_batch, meta_info=batch.meta_info)
        except Exception as exc:
            warnings.warn(f"otb_torch.verl: could not give verl's variance_proxy metrics {names} from TransferQueue "
                          f"({exc!r}); they are not logged this step", stacklevel=2)
        return verl_function(batch, *args, **kwargs)

    compute_variance_proxy_metrics.__qualname__ = f"{verl_function.__qualname__}[otb_torch.verl: + sum_pi_squared]"
    return compute_variance_proxy_metrics


def _v1_route() -> tuple[list[_Replacement], list[_ClassPatch], list[str]]:
    """The places of the v1 trainer route: three methods of verl's ``PPOTrainer`` and two functions they call;
    or, where verl's v1 trainer module does not import (a process that never runs the trainer: the hook installs in
    every Ray worker), none, with the reason."""
    try:
        trainer_base = importlib.import_module(_V1_TRAINER)
    except Exception as exc:          # whatever stops the import in a worker must not stop the worker's setup hook
        return [], [], [f"{_V1_TRAINER}.{_V1_CLASS}: cannot be imported here ({exc!r})"]
    trainer = getattr(trainer_base, _V1_CLASS, None)
    methods = {name: getattr(trainer, "__dict__", {}).get(name)
               for name in (_V1_OLD_LOG_PROB, _V1_ADVANTAGE, _V1_METRICS)}
    functions = {name: getattr(trainer_base, name, None) for name in (_V1_ADVANTAGE_FUNCTION, _V1_PROXY_FUNCTION)}
    missing = ([name for name, method in methods.items() if method is None]
               + [name for name, function in functions.items() if not callable(function)])
    if trainer is None or missing:
        return [], [], [f"{_V1_TRAINER}: no {_V1_CLASS if trainer is None else ', '.join(missing)} in this verl "
                        f"({getattr(sys.modules.get('verl'), '__version__', None)}; written against "
                        f"{TESTED_VERL_VERSION}): nothing patched"]
    wraps = {_V1_OLD_LOG_PROB: _v1_old_log_prob_with_sum_pi_squared, _V1_ADVANTAGE: _v1_advantage_with_sum_pi_squared,
             _V1_METRICS: _v1_metrics_with_sum_pi_squared,
             _V1_ADVANTAGE_FUNCTION: _v1_advantage_function, _V1_PROXY_FUNCTION: _v1_proxy_function}
    patches = [_ClassPatch(trainer, name, method, wraps[name](method)) for name, method in methods.items()]
    return ([_Replacement(function, wraps[name](function), name) for name, function in functions.items()],
            patches, [])


# ----------------------------------------------------------------------------------------------------------------------
# installation


@dataclass(frozen=True)
class _Replacement:
    """verl's ``original`` object and the ``replacement`` that stands for it while installed."""

    original: Any
    replacement: Any
    name: str


@dataclass
class Installation:
    """The active routing of verl's OTB estimators to otb_torch; a context manager that uninstalls on exit.

    Attributes:
      variant, compile, check_values, sum_pi_squared, v1_trainer: the options of :func:`install`.
      estimators: registry name → the function verl now gets from ``get_adv_estimator_fn``.
      places: every patched place, as text (``module.attribute``, ``module.ADV_ESTIMATOR_REGISTRY['name']`` or
        ``module.Class.attribute``).
      unavailable: places of the fused-kernel route (``sum_pi_squared=True``) or of the v1 trainer route
        (``v1_trainer=True``) that could not be patched in this process, with the reason (a verl module that does
        not import here).
    """

    variant: str
    compile: bool
    check_values: bool
    sum_pi_squared: bool
    v1_trainer: bool
    estimators: dict[str, Callable]
    places: list[str] = field(default_factory=list)
    unavailable: list[str] = field(default_factory=list)
    _replacements: list[_Replacement] = field(default_factory=list, repr=False)
    _class_patches: list[_ClassPatch] = field(default_factory=list, repr=False)
    _active: bool = field(default=True, repr=False)
    _holders: int = field(default=1, repr=False)        # install() calls that returned it, less `with` exits

    @property
    def active(self) -> bool:
        """True until :meth:`uninstall` (or :func:`uninstall`) has run."""
        return self._active

    def options(self) -> dict[str, Any]:
        """The :func:`install` options of this installation, as keyword arguments."""
        return {"variant": self.variant, "compile": self.compile, "check_values": self.check_values,
                "sum_pi_squared": self.sum_pi_squared, "v1_trainer": self.v1_trainer}

    def uninstall(self) -> None:
        """Restore verl's own objects everywhere this installation put otb_torch's (no-op once undone)."""
        with _LOCK:
            _uninstall_locked(self)

    def __enter__(self) -> "Installation":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Leaving a ``with`` block gives back one :func:`install` call's hold: verl's objects return when the last
        holder leaves — so an inner ``with install():`` (the same options, the same installation) does not undo an
        outer one, nor a plain ``install()`` made earlier. :meth:`uninstall` and :func:`uninstall` undo it at once."""
        with _LOCK:
            self._holders -= 1
            if self._holders <= 0:
                _uninstall_locked(self)


_LOCK = threading.RLock()
_ACTIVE: Installation | None = None


def _import_verl(module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except ImportError as exc:
        missing = (getattr(exc, "name", None) or module_name).split(".")[0]
        raise ModuleNotFoundError(f"otb_torch.verl.install: cannot import {module_name}: the package {missing!r} is "
                                  f"missing or broken ({exc}); {_INSTALL_HINT}") from exc


def _verl_modules() -> list[tuple[str, Any]]:
    return [(name, module) for name, module in list(sys.modules.items())
            if module is not None and (name == "verl" or name.startswith("verl."))]


def _swap_module_attributes(swaps: dict[int, tuple[Any, Any, str]], record: list[str] | None) -> None:
    """In every loaded verl module, replace each attribute that *is* a key object (by id) with its counterpart."""
    for module_name, module in _verl_modules():
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attribute, value in list(namespace.items()):
            swap = swaps.get(id(value))
            if swap is not None and value is swap[0]:
                setattr(module, attribute, swap[1])
                if record is not None:
                    record.append(f"{module_name}.{attribute}")


def install(variant: str = "verl", *, compile: bool = False, check_values: bool = True,
            sum_pi_squared: bool = False, v1_trainer: bool = False) -> Installation:
    """Route verl's ``optimal_token_baseline`` and ``tir_optimal_token_baseline`` estimators to otb_torch.

    Args:
      variant: ``"verl"`` — verl's self-inclusive OTB, Bₜ = Σᵢ GₜⁱWₜⁱmₜⁱ / (Σᵢ Wₜⁱmₜⁱ + ε) with verl's zero tail
        (the drop-ins ``otb_torch.compute_*optimal_token_baseline_advantage``: the same advantages and returns within
        float32 rounding, vectorized); ``"leave_one_out"`` — the sums run over the *other* members j ≠ i (unbiased,
        proofs/T3): :func:`compute_leave_one_out_token_baseline_advantage` and its multi-turn twin, under the same
        two names, so a verl config needs no other change.
      compile: fuse the computation with ``torch.compile`` (the first call compiles).
      check_values: validate the inputs (one host synchronisation per advantage call — two per fused forward with
        ``sum_pi_squared=True`` — and one more to tell a Σπ² rounded to half precision, which is then checked without
        the rule Σπ² ≥ π² — docs/verl.md, *bf16 training*; bad input raises the reference's error naming the argument by
        verl's name, under both variants, instead of producing NaN).
      sum_pi_squared: also give the actor's Σπ² (FSDP engine) from the port — call it this way in the actor workers:
        ``verl.utils.torch_functional.calculate_sum_pi_squared_from_logits`` becomes the port's memory-bounded ratio
        form S₂/S₁² accumulated in float32; and with fused kernels (``use_fused_kernels=True``, torch backend), which
        verl 0.9.1 refuses with Σπ², ``FusedLinearForPPO`` becomes :func:`otb_torch.fused_linear_token_statistics`
        (the same log π and entropy with exact gradients, never materialising the logits, and Σπ² from the same
        pass), verl's fused model forwards attach that Σπ² to their output, and
        ``FSDPEngineWithLMHead.prepare_model_outputs`` returns it instead of refusing (it still refuses, saying what
        to do, where the forward gave none: the Liger or Triton backends). Call it before the model is built, or
        after: model classes verl already patched are found. The port's Σπ² is not differentiable (verl only uses
        Σπ² under no_grad, for advantages and metrics).
      v1_trainer: also let verl's v1 trainer (``trainer.use_v1=True``, verl 0.9.1's default) run OTB — call it this way
        in the process that runs the trainer. verl's v1 ``PPOTrainer`` never asks the actor for Σπ² nor reads it for the
        advantage step, so its OTB stops at verl's assertion "requires sum_pi_squared from actor". With this option
        ``PPOTrainer._compute_old_log_prob`` asks the actor for Σπ² where
        ``actor_rollout_ref.actor.calculate_sum_pi_squared`` is set and the estimator is one of the two OTB names, and
        stores it per response token in TransferQueue, and ``PPOTrainer._compute_advantage`` gives it to verl's
        ``compute_advantage``, as the legacy trainer does (rollout correction's bypass mode, which runs no actor
        forward, is refused with a ValueError saying so); ``PPOTrainer._compute_metrics`` gives verl's
        ``compute_variance_proxy_metrics`` Σπ², old log π and ρ, so the ``variance_proxy/*`` metrics are logged. Imports
        verl's v1 trainer module (and its ``transfer_queue`` dependency); where that fails, the places are listed in
        ``Installation.unavailable`` instead (a Ray worker that never runs the trainer).

    Returns:
      The :class:`Installation` (a context manager: ``with otb_torch.verl.install(): ...`` uninstalls on exit).
      Installing again with the same options returns the active installation, held once more: leaving a ``with``
      block undoes it only when every :func:`install` call that returned it has left its block, so nested blocks
      and a plain ``install()`` made earlier are not undone by an inner block (:func:`uninstall` undoes it at once);
      with different options it raises ``RuntimeError`` (call :func:`uninstall` first).

    Raises:
      ValueError: unknown ``variant``; TypeError: a flag that is not a bool; ModuleNotFoundError: verl (or a package
      its advantage code imports) is not installed; RuntimeError: another patch already replaced verl's registry
      entry.
    """
    if not isinstance(variant, str) or variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    options = {"variant": variant, "compile": reference_checks.flag("compile", compile),
               "check_values": reference_checks.flag("check_values", check_values),
               "sum_pi_squared": reference_checks.flag("sum_pi_squared", sum_pi_squared),
               "v1_trainer": reference_checks.flag("v1_trainer", v1_trainer)}
    global _ACTIVE
    with _LOCK:
        if _ACTIVE is not None:
            if _ACTIVE.options() == options:
                _ACTIVE._holders += 1
                return _ACTIVE
            raise RuntimeError(f"otb_torch.verl is already installed with {_ACTIVE.options()}; call "
                               f"otb_torch.verl.uninstall() before installing with {options}")
        core_algos = _import_verl(_CORE_ALGOS)
        torch_functional = _import_verl(_TORCH_FUNCTIONAL) if options["sum_pi_squared"] else None
        _warn_if_untested_version()
        registry = getattr(core_algos, _REGISTRY)
        bound_options = {"check_values": options["check_values"], "compile": options["compile"]}
        replacements: list[_Replacement] = []
        estimators: dict[str, Callable] = {}
        for name, function_name in _VERL_FUNCTIONS.items():
            original = getattr(core_algos, function_name)
            if registry.get(name) is not original:
                raise RuntimeError(f"{_CORE_ALGOS}.{_REGISTRY}[{name!r}] holds {registry.get(name)!r}, not verl's "
                                   f"{function_name}: something else has replaced it; undo that first")
            estimators[name] = _with_options(_ESTIMATORS[variant][name], bound_options, f"otb_torch.verl:{variant}")
            replacements.append(_Replacement(original, estimators[name], name))
        if torch_functional is not None:
            original = getattr(torch_functional, _SUM_PI_SQUARED)
            replacements.append(_Replacement(
                original, _with_options(otb_torch.calculate_sum_pi_squared_from_logits,
                                        {"check_values": options["check_values"]}, "otb_torch.verl"), _SUM_PI_SQUARED))
        class_patches: list[_ClassPatch] = []
        unavailable: list[str] = []
        if options["sum_pi_squared"]:
            fused_replacements, class_patches, unavailable = _fused_route(options["check_values"])
            replacements.extend(fused_replacements)
        if options["v1_trainer"]:
            v1_replacements, v1_patches, v1_unavailable = _v1_route()
            replacements.extend(v1_replacements)
            class_patches.extend(v1_patches)
            unavailable.extend(v1_unavailable)
        installation = Installation(estimators=estimators, unavailable=unavailable, _replacements=replacements,
                                    _class_patches=class_patches, **options)
        for name, estimator in estimators.items():
            registry[name] = estimator
            installation.places.append(f"{_CORE_ALGOS}.{_REGISTRY}[{name!r}]")
        _swap_module_attributes({id(r.original): (r.original, r.replacement, r.name) for r in replacements},
                                installation.places)
        for patch in class_patches:
            setattr(patch.owner, patch.attribute, patch.replacement)
            installation.places.append(f"{patch.owner.__module__}.{patch.owner.__qualname__}.{patch.attribute}")
        _ACTIVE = installation
        return installation


def _uninstall_locked(installation: Installation) -> None:
    global _ACTIVE
    if not installation._active:
        return
    core_algos = sys.modules.get(_CORE_ALGOS)
    if core_algos is not None:
        registry = getattr(core_algos, _REGISTRY)
        for replacement in installation._replacements:
            if replacement.name not in _VERL_FUNCTIONS:
                continue
            if registry.get(replacement.name) is replacement.replacement:
                registry[replacement.name] = replacement.original
            else:
                warnings.warn(f"{_CORE_ALGOS}.{_REGISTRY}[{replacement.name!r}] was changed after "
                              "otb_torch.verl.install(); left as found", stacklevel=3)
    _swap_module_attributes({id(r.replacement): (r.replacement, r.original, r.name)
                             for r in installation._replacements}, None)
    for patch in installation._class_patches:
        if patch.owner.__dict__.get(patch.attribute) is patch.replacement:
            setattr(patch.owner, patch.attribute, patch.original)
        else:
            warnings.warn(f"{patch.owner.__qualname__}.{patch.attribute} was changed after otb_torch.verl.install(); "
                          "left as found", stacklevel=3)
    transformers = sys.modules.get("transformers")
    wrapped_forwards = {id(r.replacement): r.original for r in installation._replacements if r.name == _FUSED_FORWARD}
    if transformers is not None and wrapped_forwards:   # classes verl's apply_monkey_patch patched while installed
        for model_class in _loaded_subclasses(transformers.PreTrainedModel):
            original = wrapped_forwards.get(id(model_class.__dict__.get("forward")))
            if original is not None:
                model_class.forward = original
    for head in list(_REGISTERED_HEADS):            # the pass registered as a forward method of FSDP2 lm_heads
        head.__dict__.pop(_HEAD_METHOD, None)
    _REGISTERED_HEADS.clear()
    installation._active = False
    if _ACTIVE is installation:
        _ACTIVE = None


def uninstall() -> bool:
    """Undo :func:`install`: verl's registry entries and every module attribute are verl's own objects again
    (``is`` identity), including by-name imports made while installed. Returns whether anything was installed."""
    with _LOCK:
        if _ACTIVE is None:
            return False
        _uninstall_locked(_ACTIVE)
        return True


def installed() -> Installation | None:
    """The active :class:`Installation` in this process, or None."""
    return _ACTIVE


def _warn_if_untested_version() -> None:
    version = getattr(sys.modules.get("verl"), "__version__", None)
    if version != TESTED_VERL_VERSION:
        warnings.warn(f"otb_torch.verl was written against verl {TESTED_VERL_VERSION} and found verl {version}: "
                      "check that compute_advantage still passes old_log_probs, sum_pi_squared and "
                      "rollout_is_weights to the OTB estimator names", stacklevel=3)


_ENVIRONMENT = {"variant": "OTB_VERL_VARIANT", "compile": "OTB_VERL_COMPILE", "check_values": "OTB_VERL_CHECK_VALUES",
                "sum_pi_squared": "OTB_VERL_SUM_PI_SQUARED", "v1_trainer": "OTB_VERL_V1_TRAINER"}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def install_from_environment() -> Installation:
    """:func:`install` with its options read from environment variables — for a Ray worker setup hook
    (``runtime_env={"worker_process_setup_hook": "otb_torch.verl.install_from_environment"}``), which runs in every
    Ray worker process: the TaskRunner that computes advantages and the actor workers that compute Σπ².

    ===========================  ==============================  =========
    variable                     meaning                         default
    ===========================  ==============================  =========
    ``OTB_VERL_VARIANT``         ``verl`` or ``leave_one_out``   ``verl``
    ``OTB_VERL_SUM_PI_SQUARED``  replace the actor's Σπ²         ``no``
    ``OTB_VERL_V1_TRAINER``      OTB in verl's v1 trainer        ``no``
    ``OTB_VERL_COMPILE``         ``torch.compile``               ``no``
    ``OTB_VERL_CHECK_VALUES``    validate inputs                 ``yes``
    ===========================  ==============================  =========

    Flags take yes/no, true/false, on/off or 1/0 (write yes/no on Hydra's command line: it would pass 1 as an
    integer, and Ray accepts only strings in ``env_vars``).
    """
    options: dict[str, Any] = {"variant": os.environ.get(_ENVIRONMENT["variant"], "verl").strip()}
    defaults = {"compile": False, "check_values": True, "sum_pi_squared": False, "v1_trainer": False}
    for name, default in defaults.items():
        variable = _ENVIRONMENT[name]
        text = os.environ.get(variable)
        if text is None or not text.strip():
            options[name] = default
        elif text.strip().lower() in _TRUE:
            options[name] = True
        elif text.strip().lower() in _FALSE:
            options[name] = False
        else:
            raise ValueError(f"{variable}: expected one of {_TRUE + _FALSE}, got {text!r}")
    if options["variant"] not in VARIANTS:
        raise ValueError(f"{_ENVIRONMENT['variant']}: expected one of {VARIANTS}, got {options['variant']!r}")
    variant = options.pop("variant")
    return install(variant, **options)
