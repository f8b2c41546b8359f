"""Calling conventions: how a target callable takes a case and returns its outputs.

A convention turns a target into a *subject* — something that runs a :class:`~otb_spec.conformance.Case` and hands back
NumPy outputs plus what the structural checks need (output dtypes and devices, which inputs the call modified) — and
writes a copy-pasteable snippet reproducing a call. Built in:

* ``verl`` — verl 0.9.1's functions, called as its trainer calls an advantage estimator (``compute_advantage`` in
  ``verl.trainer.ppo.ray_trainer``): by keyword — ``token_level_rewards``, ``response_mask`` (int64, as the trainer
  holds it), ``config`` (the trainer's algorithm config, :func:`verl_algorithm_config`; verl's own functions take it
  into ``**kwargs``), ``index`` (a NumPy array of ids), ``sum_pi_squared``, ``old_log_probs``,
  ``rollout_is_weights`` (None when the case has none) — torch tensors;
  ``handle_zero_tail`` and ``epsilon`` only where the case's differ from verl's defaults (True, 1e-8), so that a
  target's own defaults are what the trainer gets. A target whose signature cannot take those keywords (other
  parameter names, no room for ``config``) but takes verl's positional order is checked positionally instead —
  ``f(token_level_rewards, response_mask, index, old_log_probs, sum_pi_squared, rollout_is_weights=…,
  handle_zero_tail=…, epsilon=…)``, both options always passed — with a warning from the signature layer that verl's
  trainer could not call it. otb/tir-otb return ``(advantages, returns)``; sum-pi-squared: ``f(logits)`` → a tensor.
* ``numpy`` — the reference's own signature on NumPy arrays: (rewards, response_mask, group_ids, log_probs,
  sum_pi_squared, *, is_weights, handle_zero_tail, epsilon) → (advantages, returns, …); loo-otb without
  handle_zero_tail, tir-loo-otb with ``align="valid_token"`` instead of it; sum-pi-squared (logits) → array.
* ``grouped`` — contiguous equal-size groups in a [G, N, T] layout (NumPy), no ids: (rewards, response_mask,
  log_probs, sum_pi_squared, *, is_weights, handle_zero_tail, epsilon) → (advantages, returns) in [G, N, T].
* ``jax`` — ``jax.Array`` inputs with integer segment ids and a static count: (rewards, response_mask, segment_ids,
  num_segments, log_probs, sum_pi_squared, *, is_weights, handle_zero_tail, epsilon) → (advantages, returns, …).

The fused-token-statistics kind is called the same way under all three conventions that offer it — ``verl`` (torch
tensors; gradients by ``torch.autograd.grad``), ``numpy`` (values only) and ``jax`` (gradients by ``jax.vjp``):
``target(hidden, weight, token_ids, temperature=τ)`` → ``(log_probs, entropy)``, ``(log_probs, entropy,
sum_pi_squared)`` or an object with those attributes (``otb_spec.conformance._fused``). A target that is a class (verl's
``FusedLinearForPPO``, a ``torch.nn.Module``) is instantiated once with no arguments and the instance is called.

Add one with :func:`register_convention`. Adapters (``otb_spec.adapters``) are subjects too (:func:`adapter_subject`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import numpy as np

from otb_spec.conformance._cases import _OTB_KINDS, FUSED, LEAVE_ONE_OUT_KINDS, Case, alignment, reference_options
from otb_spec.conformance._fused import subject_for as _fused_subject
from otb_spec.conformance._subjects import (Outcome, Subject, _bind_problem, _case_source, _import_line, _jax_device,
                                            _jax_placement, _jax_put, _numpy_dtype, _outcome, _Shown, _torch,
                                            _torch_dtype, changed)

__all__ = ["Outcome", "Subject", "Convention", "CONVENTIONS", "register_convention", "adapter_subject",
           "verl_algorithm_config"]


@dataclass(frozen=True)
class Convention:
    """A named calling convention: ``build(target, target_spec, kind, device) → Subject``.

    ``target`` is the callable, ``target_spec`` how the user named it (``"pkg.mod:fn"`` or ``"file.py:fn"``, used in
    snippets), ``kind`` one of :data:`~otb_spec.conformance.KINDS`, ``device`` e.g. ``"cpu"`` or ``"cuda"``."""

    name: str
    description: str
    kinds: tuple[str, ...]
    build: Callable[..., Subject]


CONVENTIONS: dict[str, Convention] = {}

_REFERENCE_FUNCTIONS = {"otb": "optimal_token_baseline", "tir-otb": "multi_turn_optimal_token_baseline",
                        "loo-otb": "leave_one_out_token_baseline", "tir-loo-otb": "leave_one_out_token_baseline",
                        "sum-pi-squared": "sum_pi_squared"}
"""The reference function (``otb_spec.<name>``) each kind is checked against."""


def register_convention(convention: Convention) -> None:
    """Add (or replace) a calling convention."""
    if not isinstance(convention, Convention):
        raise TypeError(f"convention: expected a Convention, got {type(convention).__name__}")
    CONVENTIONS[convention.name] = convention


# ----------------------------------------------------------------------------------------------------------------------
# helpers


def _signature_check(target: Callable, positional: int, weights_name: str) -> Callable[[str], str | None]:
    """``kind → problem``: Σπ² takes one argument; OTB kinds ``positional`` ones plus the weights (``weights_name``),
    ``epsilon`` and, except leave-one-out, ``handle_zero_tail`` as keywords."""
    def problem(kind: str) -> str | None:
        if kind == "sum-pi-squared":
            return _bind_problem(target, 1, {})
        keywords = {weights_name: None, "epsilon": 1e-8, **reference_options(kind)}
        if kind not in LEAVE_ONE_OUT_KINDS:
            keywords["handle_zero_tail"] = True
        return _bind_problem(target, positional, keywords)

    return problem


# how a snippet turns `got` (a pair of arrays, or one array for Σπ²) into float64 NumPy
_ARRAY_OUTPUTS = ("np.asarray(got[0], dtype=np.float64)", "np.asarray(got[1], dtype=np.float64)",
                  "np.asarray(got, dtype=np.float64)")


def _reference_line(case: Case) -> str:
    if case.kind == "sum-pi-squared":
        return "expected = otb_spec.sum_pi_squared(logits)"
    return (f"expected = otb_spec.{_REFERENCE_FUNCTIONS[case.kind]}(rewards, response_mask, group_ids, log_probs, "
            f"sum_pi_squared, is_weights=is_weights{_option_keywords(case.kind)}, epsilon=epsilon)")


def _align_options(kind: str, always: bool = False) -> dict[str, str]:
    """``align`` as a call passes it: multi-turn leave-one-out always; position leave-one-out only with ``always``
    (an adapter: the protocol has the parameter, a target function may not)."""
    if kind in LEAVE_ONE_OUT_KINDS and always:
        return {"align": alignment(kind)}
    return reference_options(kind)


def _option_keywords(kind: str) -> str:
    """The zero-tail or align keyword of a kind's call, as source text (``", handle_zero_tail=handle_zero_tail"``)."""
    if kind in LEAVE_ONE_OUT_KINDS:
        return "".join(f", {key}={value!r}" for key, value in reference_options(kind).items())
    return ", handle_zero_tail=handle_zero_tail"


def _difference_line(case: Case, got_advantages: str, got_returns: str, got_spp: str) -> str:
    """A line printing the largest |got − expected| of each output (``got_*``: expressions giving float64 arrays)."""
    if case.kind == "sum-pi-squared":
        return f'print("max |got - expected|: sum_pi_squared", abs({got_spp} - expected).max())'
    return (f'print("max |got - expected|: advantages", abs({got_advantages} - expected.advantages).max(), '
            f'"returns", abs({got_returns} - expected.returns).max())')


def _described_call(case: Case, names: dict[str, str], array: Callable[[np.ndarray, str], _Shown],
                    ids: Callable[[np.ndarray], Any] | None, zero_tail: bool = True,
                    align_always: bool = False) -> str:
    """The call of an OTB kind (or Σπ²) described from the case: ``names`` maps the case's fields to the target's
    argument names, ``array`` says how an input array reaches the target, ``ids`` how the group ids do (None: no ids)."""
    if case.kind == "sum-pi-squared":
        return "(" + f"{names.get('logits', 'logits')}={array(case.logits, case.dtype)}" + ")"
    parts = []
    for field_name in ("rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared", "is_weights"):
        if field_name == "group_ids":
            if ids is not None:
                parts.append(f"{names['group_ids']}={ids(case.group_ids)}")
            continue
        value = getattr(case, field_name)
        parts.append(f"{names.get(field_name, field_name)}={'None' if value is None else array(value, case.dtype)}")
    if case.kind not in LEAVE_ONE_OUT_KINDS and zero_tail:
        parts.append(f"handle_zero_tail={case.handle_zero_tail!r}")
    parts += [f"{key}={value!r}" for key, value in _align_options(case.kind, align_always).items()]
    parts.append(f"epsilon={case.epsilon!r}")
    return "(" + ", ".join(parts) + ")"


def _pair(result: Any, names: tuple[str, str] = ("advantages", "returns")) -> tuple[Any, Any]:
    """(advantages, returns) from a tuple/list of at least two, or an object with those attributes."""
    if all(hasattr(result, name) for name in names):
        return getattr(result, names[0]), getattr(result, names[1])
    if isinstance(result, (tuple, list)) and len(result) >= 2:
        return result[0], result[1]
    raise TypeError(f"expected (advantages, returns) — a tuple of two arrays — got {type(result).__name__}")


# ----------------------------------------------------------------------------------------------------------------------
# verl (torch)


def _verl(target: Callable, target_spec: str, kind: str, device: str) -> Subject:
    if kind == FUSED:
        return _fused_subject("verl", target, target_spec, device)
    torch = _torch()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' (--device cuda): torch sees no CUDA device on this machine")

    def tensor(array: np.ndarray, dtype: str):
        host = np.array(array, dtype=np.float32 if dtype != "float64" else np.float64, copy=True)
        return torch.from_numpy(host).to(device=device, dtype=_torch_dtype(dtype))

    def mask_tensor(case: Case):
        if _verl_mask_dtype(case) == "int64":
            return torch.from_numpy(np.asarray(case.response_mask).astype(np.int64)).to(device=device)
        return tensor(case.response_mask, case.dtype)

    keyword_problem = None if kind == "sum-pi-squared" else _verl_keyword_problem(target)
    by_keyword = keyword_problem is None
    positional_problem = _signature_check(target, 5, "rollout_is_weights")     # verl's order, the options as keywords

    def run(case: Case) -> Outcome:
        if kind == "sum-pi-squared":
            inputs = {"logits": tensor(case.logits, case.dtype)}
            results = (("sum_pi_squared", target(inputs["logits"])),)
        else:
            inputs = {"token_level_rewards": tensor(case.rewards, case.dtype),
                      "response_mask": mask_tensor(case),
                      "old_log_probs": tensor(case.log_probs, case.dtype),
                      "sum_pi_squared": tensor(case.sum_pi_squared, case.dtype)}
            if case.is_weights is not None:
                inputs["rollout_is_weights"] = tensor(case.is_weights, case.dtype)
        before = {name: value.clone() for name, value in inputs.items()}
        if kind != "sum-pi-squared":
            index = np.array(case.group_ids, copy=True)
            index_before = index.copy()
            if by_keyword:
                config = verl_algorithm_config(kind, rollout_is=case.is_weights is not None)
                result = target(**_verl_keywords(case, inputs, index, config))
            else:
                result = target(inputs["token_level_rewards"], inputs["response_mask"], index,
                                inputs["old_log_probs"], inputs["sum_pi_squared"],
                                rollout_is_weights=inputs.get("rollout_is_weights"),
                                handle_zero_tail=case.handle_zero_tail, epsilon=case.epsilon)
            results = tuple(zip(("advantages", "returns"), _pair(result)))
        outcome = _outcome(results, {str(value.device) for value in inputs.values()})
        outcome.mutated = [name for name, value in inputs.items() if changed(before[name], value)]
        if kind != "sum-pi-squared" and changed(index_before, index):
            outcome.mutated.append("index")
        return outcome

    def snippet(case: Case) -> str:
        lines = [_case_source(case), "import torch, otb_spec, otb_spec.conformance", _import_line(target_spec),
                 f"t = lambda a: None if a is None else torch.as_tensor(a).to(device={device!r}, "
                 f"dtype=torch.{case.dtype})"]
        mask = f"torch.as_tensor(response_mask).to(device={device!r}, dtype=torch.{_verl_mask_dtype(case)})"
        if kind == "sum-pi-squared":
            lines.append("got = target(t(logits))")
        else:
            options = "" if by_keyword and _verl_defaults(case) else \
                ", handle_zero_tail=handle_zero_tail, epsilon=epsilon"
            if by_keyword:
                config = (f"otb_spec.conformance.verl_algorithm_config({kind!r}, "
                          f"rollout_is={case.is_weights is not None})")
                lines.append("got_advantages, got_returns = target(token_level_rewards=t(rewards), "
                             f"response_mask={mask}, config={config}, index=group_ids, "
                             "sum_pi_squared=t(sum_pi_squared), old_log_probs=t(log_probs), "
                             f"rollout_is_weights=t(is_weights){options})")
            else:
                lines.append(f"got_advantages, got_returns = target(t(rewards), {mask}, group_ids, "
                             f"t(log_probs), t(sum_pi_squared), rollout_is_weights=t(is_weights){options})")
        lines.append(_reference_line(case))
        host = "{}.detach().double().cpu().numpy()"
        lines.append(_difference_line(case, host.format("got_advantages"), host.format("got_returns"),
                                      host.format("got")))
        return "\n".join(lines)

    def describe_call(case: Case) -> str:
        if case.kind == "sum-pi-squared":
            return _described_call(case, {}, lambda a, dtype: _Shown("Tensor", a, dtype, device), None)
        shown = {name: "None" if value is None else _Shown("Tensor", value, case.dtype, device)
                 for name, value in (("token_level_rewards", case.rewards), ("sum_pi_squared", case.sum_pi_squared),
                                     ("old_log_probs", case.log_probs), ("rollout_is_weights", case.is_weights))}
        shown["response_mask"] = _Shown("Tensor", case.response_mask, _verl_mask_dtype(case), device)
        shown["index"] = _Shown("ndarray", case.group_ids, str(np.asarray(case.group_ids).dtype))
        if not by_keyword:                                      # positionally, in verl's order
            return "(" + ", ".join(str(shown[name]) for name in _VERL_POSITIONAL) + ", " + ", ".join(
                f"{name}={value}" for name, value in (("rollout_is_weights", shown["rollout_is_weights"]),
                                                     ("handle_zero_tail", case.handle_zero_tail),
                                                     ("epsilon", case.epsilon))) + ")"
        shown["config"] = (f"{type(verl_algorithm_config()).__name__} (verl's trainer algorithm config: "
                           f"otb_spec.conformance.verl_algorithm_config({case.kind!r}, "
                           f"rollout_is={case.is_weights is not None}))")
        keywords = _verl_keywords(case, shown, shown["index"], None)
        return "(" + ", ".join(f"{name}={shown[name]}" if name in shown else f"{name}={value!r}"
                               for name, value in keywords.items()) + ")"

    def signature_problem(kind: str) -> str | None:
        if kind == "sum-pi-squared":
            return positional_problem(kind)
        return None if by_keyword or positional_problem(kind) is None else keyword_problem

    def signature_note(kind: str) -> str | None:
        if by_keyword:
            return None
        return (f"verl's trainer could not call this target: {keyword_problem}. Checked through "
                "positional calls in verl's order instead — f(token_level_rewards, response_mask, index, "
                "old_log_probs, sum_pi_squared, rollout_is_weights=…, handle_zero_tail=…, epsilon=…), both options "
                "always passed, so its own defaults are not checked; to register it as verl's estimator, give it "
                "verl's parameter names and **kwargs")

    return Subject(f"{target_spec} (verl convention, {device})", ("otb", "tir-otb", "sum-pi-squared"), device, run,
                   snippet, signature_problem, signature_note=signature_note, describe_call=describe_call,
                   mask_dtype=_verl_mask_dtype)


_VERL_DEFAULTS = {"handle_zero_tail": True, "epsilon": 1e-8}    # compute_optimal_token_baseline_advantage's
_VERL_POSITIONAL = ("token_level_rewards", "response_mask", "index", "old_log_probs", "sum_pi_squared")
_VERL_KEYWORDS = ("token_level_rewards", "response_mask", "config", "index", "sum_pi_squared", "old_log_probs",
                  "rollout_is_weights")                           # compute_advantage's adv_kwargs, in its order


_VERL_ESTIMATORS = {"otb": "optimal_token_baseline", "tir-otb": "tir_optimal_token_baseline"}


def verl_algorithm_config(kind: str = "otb", rollout_is: bool = False) -> Mapping:
    """The ``config`` verl 0.9.1's trainer passes an advantage estimator: ``self.config.algorithm``
    (``compute_advantage`` in ``verl.trainer.ppo.ray_trainer``), a Hydra-composed OmegaConf ``DictConfig`` in struct
    mode — the defaults of verl's ``trainer/config/_generated_ppo_trainer.yaml`` with ``adv_estimator`` set for ``kind``
    (``"otb"`` → ``optimal_token_baseline``, ``"tir-otb"`` → ``tir_optimal_token_baseline``) and, with ``rollout_is``,
    rollout importance weights turned on per token (which is when verl computes ``rollout_is_weights``). A
    ``DictConfig`` where omegaconf is installed, else a stand-in with its behaviour: ``config.key`` and
    ``config["key"]``, ``config.get(key, default)``, ``key in config``, assignment to an existing key; a key it lacks
    raises (AttributeError, KeyError), as struct mode does. So an estimator that reads its options from ``config`` is
    checked with what the trainer gives it. A fresh one per call."""
    if kind not in _VERL_ESTIMATORS:
        raise ValueError(f"kind must be one of {sorted(_VERL_ESTIMATORS)} (verl's OTB estimators), got {kind!r}")
    values = {
        "rollout_correction": {"rollout_is": "token" if rollout_is else None, "rollout_is_threshold": 2.0,
                               "rollout_rs": None, "rollout_rs_threshold": None, "bypass_mode": False,
                               "loss_type": "ppo_clip", "rollout_is_batch_normalize": False},
        "_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0, "adv_estimator": _VERL_ESTIMATORS[kind],
        "norm_adv_by_std_in_grpo": True,
        "filter_groups": {"_target_": "verl.trainer.config.FilterGroupsConfig", "enable": False, "metric": "reward",
                          "max_num_gen_batches": 0, "max_inflight_gen_batches": 1},
        "use_kl_in_reward": False, "kl_penalty": "kl",
        "kl_ctrl": {"_target_": "verl.trainer.config.KLControlConfig", "type": "fixed", "kl_coef": 0.001,
                    "horizon": 10000, "target_kl": 0.1},
        "use_pf_ppo": False, "pf_ppo": {"reweight_method": "pow", "weight_pow": 2.0}}
    try:
        from omegaconf import OmegaConf
    except ImportError:
        return _StructConfig(values)
    config = OmegaConf.create(values)
    OmegaConf.set_struct(config, True)
    return config


class _StructConfig(Mapping):
    """A nested mapping with attribute access that raises on a missing key, as an OmegaConf ``DictConfig`` in struct
    mode does (:func:`verl_algorithm_config` without omegaconf): an existing key may be assigned (``config.gamma =
    0.5``, ``config["gamma"] = 0.5``), a new one raises. Not hashable, and not accepted by OmegaConf's own helpers."""

    def __init__(self, values: dict):
        object.__setattr__(self, "_values", {key: _StructConfig(value) if isinstance(value, dict) else value
                                             for key, value in values.items()})

    def __getitem__(self, key: str) -> Any:
        return self._values[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "_values":       # copy and pickle look these up before __init__ ran
            raise AttributeError(name)
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(f"Key '{name}' is not in struct") from None

    def __setitem__(self, key: str, value: Any) -> None:
        if key not in self._values:
            raise KeyError(f"Key '{key}' is not in struct")
        self._values[key] = value

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in self._values:
            raise AttributeError(f"Key '{name}' is not in struct")
        self._values[name] = value

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._values!r})"


def _verl_mask_dtype(case: Case) -> str:
    """The dtype of ``response_mask`` as verl's trainer holds it: int64 (its agent loop and ``compute_response_mask``
    slice the int64 attention mask; ``get_response_mask`` builds int64), or the case's dtype where it is not 0/1."""
    return "int64" if np.isin(np.asarray(case.response_mask), (0, 1)).all() else case.dtype


def _verl_defaults(case: Case) -> bool:
    """Whether the case's options are verl's defaults, which its trainer never passes."""
    return case.handle_zero_tail == _VERL_DEFAULTS["handle_zero_tail"] and case.epsilon == _VERL_DEFAULTS["epsilon"]


def _verl_keywords(case: Case, inputs: dict, index: Any, config: Any) -> dict:
    """The keyword arguments of verl 0.9.1's trainer (``compute_advantage``: ``adv_estimator_fn(**adv_kwargs)``), in
    its order, from ``inputs`` keyed by verl's names and the trainer's algorithm ``config``; the options only where
    they differ from verl's defaults."""
    keywords = {name: {"index": index, "config": config}.get(name, inputs.get(name)) for name in _VERL_KEYWORDS}
    if not _verl_defaults(case):
        keywords.update(handle_zero_tail=case.handle_zero_tail, epsilon=case.epsilon)
    return keywords


def _verl_keyword_problem(target: Callable) -> str | None:
    """None, or why ``target`` cannot take verl's trainer's keywords and the two options (an OTB kind)."""
    found = _bind_problem(target, 0, dict(dict.fromkeys(_VERL_KEYWORDS), **_VERL_DEFAULTS))
    return found and (f"{found} — verl 0.9.1's trainer calls an advantage estimator by keyword, with verl's "
                      "argument names and config=… (compute_advantage in verl.trainer.ppo.ray_trainer)")


# ----------------------------------------------------------------------------------------------------------------------
# numpy and grouped


def _group_order(group_ids: np.ndarray) -> tuple[np.ndarray, int] | str:
    """Rows sorted so that groups are contiguous (groups in order of first appearance, members in row order), and
    the group size — or why the case has no [G, N, T] layout (unequal group sizes)."""
    codes: dict = {}
    labels = np.array([codes.setdefault(repr(g), len(codes)) for g in np.asarray(group_ids, dtype=object).tolist()])
    sizes = np.bincount(labels)
    if sizes.min() != sizes.max():
        return f"groups of unequal sizes {sorted(set(sizes.tolist()))} have no [G, N, T] layout"
    return np.argsort(labels, kind="stable"), int(sizes[0])


def _numpy(target: Callable, target_spec: str, kind: str, device: str, grouped: bool = False) -> Subject:
    if kind == FUSED and not grouped:
        return _fused_subject("numpy", target, target_spec, device)
    def array(values: np.ndarray, dtype: str) -> np.ndarray:
        return np.asarray(values, dtype=np.float32 if dtype != "float64" else np.float64).astype(_numpy_dtype(dtype))

    def run(case: Case) -> Outcome:
        if kind == "sum-pi-squared":
            inputs = {"logits": array(case.logits, case.dtype)}
            before = {"logits": inputs["logits"].copy()}
            results = (("sum_pi_squared", target(inputs["logits"])),)
        else:
            names = ("rewards", "response_mask", "log_probs", "sum_pi_squared", "is_weights")
            inputs = {name: array(getattr(case, name), case.dtype) for name in names if getattr(case, name) is not None}
            rows, positions = case.rewards.shape
            order = None
            if grouped:
                order, size = _group_order(case.group_ids)
                inputs = {name: value[order].reshape(rows // size, size, positions) for name, value in inputs.items()}
            before = {name: value.copy() for name, value in inputs.items()}
            keywords = {"is_weights": inputs.get("is_weights"), "epsilon": case.epsilon, **reference_options(kind)}
            if kind not in LEAVE_ONE_OUT_KINDS:
                keywords["handle_zero_tail"] = case.handle_zero_tail
            ids = () if grouped else (case.group_ids,)
            result = target(inputs["rewards"], inputs["response_mask"], *(np.array(i, copy=True) for i in ids),
                            inputs["log_probs"],
                            inputs["sum_pi_squared"], **keywords)
            results = tuple(zip(("advantages", "returns"), _pair(result)))
            if grouped:
                unsorted = []
                for name, value in results:
                    host = np.asarray(value)
                    if host.size == rows * positions:
                        flat = np.empty_like(host.reshape(rows, positions))
                        flat[order] = host.reshape(rows, positions)
                        host = flat
                    unsorted.append((name, host))
                results = tuple(unsorted)
        outcome = _outcome(results, {"cpu"})
        outcome.mutated = [name for name, value in inputs.items() if changed(before[name], value)]
        return outcome

    def snippet(case: Case) -> str:
        lines = [_case_source(case), "import otb_spec", _import_line(target_spec)]
        if kind == "sum-pi-squared":
            lines.append("got = target(logits)")
        else:
            keywords = "epsilon=epsilon" + _option_keywords(kind)
            if grouped:
                lines += ["ids = group_ids.tolist(); order = sorted(range(len(ids)), key=lambda i: "
                          "(ids.index(ids[i]), i))",
                          "G = len(dict.fromkeys(ids)); shape = (G, len(ids) // G, rewards.shape[1])",
                          "r = lambda a: None if a is None else a[order].reshape(shape)",
                          f"got = target(r(rewards), r(response_mask), r(log_probs), r(sum_pi_squared), "
                          f"is_weights=r(is_weights), {keywords})  # rows in `order`"]
            else:
                lines.append(f"got = target(rewards, response_mask, group_ids, log_probs, sum_pi_squared, "
                             f"is_weights=is_weights, {keywords})")
        lines.append(_reference_line(case))
        if grouped:
            lines.append("unsort = lambda a: np.asarray(a, dtype=np.float64).reshape(len(order), -1)"
                         "[np.argsort(order)]")
            lines.append(_difference_line(case, "unsort(got[0])", "unsort(got[1])", ""))
        else:
            lines.append(_difference_line(case, *_ARRAY_OUTPUTS))
        return "\n".join(lines)

    def expressible(case: Case) -> str | None:
        if not grouped or case.kind == "sum-pi-squared":
            return None
        order = _group_order(case.group_ids)
        return order if isinstance(order, str) else None

    kinds = _OTB_KINDS if grouped else _OTB_KINDS + ("sum-pi-squared",)
    label = "grouped" if grouped else "numpy"
    def describe_call(case: Case) -> str:
        if grouped and case.kind != "sum-pi-squared":
            order = _group_order(case.group_ids)
            size = order[1] if not isinstance(order, str) else 1
            shape = (case.rewards.shape[0] // size, size, case.rewards.shape[1])
            return _described_call(case, {}, lambda a, dtype: _Shown("ndarray", np.empty(shape), dtype), None)
        return _described_call(case, {"group_ids": "group_ids"}, lambda a, dtype: _Shown("ndarray", a, dtype),
                               lambda ids: _Shown("ndarray", ids, str(np.asarray(ids).dtype)))

    return Subject(f"{target_spec} ({label} convention)", kinds, "cpu", run, snippet,
                   _signature_check(target, 4 if grouped else 5, "is_weights"), equal_groups=grouped,
                   supports_dtype=lambda dtype: _numpy_dtype(dtype) is not None, dtype_rule="at-least",
                   expressible=expressible, describe_call=describe_call)


# ----------------------------------------------------------------------------------------------------------------------
# jax


def _jax(target: Callable, target_spec: str, kind: str, device: str) -> Subject:
    if kind == FUSED:
        return _fused_subject("jax", target, target_spec, device)
    import jax

    from otb_jax import segment_ids as to_segments

    placement = _jax_placement(device)

    def array(values: np.ndarray, dtype: str):
        return _jax_put(values, dtype, placement)

    def run(case: Case) -> Outcome:
        with jax.enable_x64(case.dtype == "float64"):
            if kind == "sum-pi-squared":
                logits = array(case.logits, case.dtype)
                return _outcome((("sum_pi_squared", target(logits)),), {_jax_device(logits)})
            ids, count = to_segments(case.group_ids)
            keywords = {"is_weights": None if case.is_weights is None else array(case.is_weights, case.dtype),
                        "epsilon": case.epsilon, **reference_options(kind)}
            if kind not in LEAVE_ONE_OUT_KINDS:
                keywords["handle_zero_tail"] = case.handle_zero_tail
            rewards = array(case.rewards, case.dtype)
            result = target(rewards, array(case.response_mask, case.dtype), jax.device_put(ids, placement), count,
                            array(case.log_probs, case.dtype), array(case.sum_pi_squared, case.dtype), **keywords)
            return _outcome(tuple(zip(("advantages", "returns"), _pair(result))), {_jax_device(rewards)})

    def snippet(case: Case) -> str:
        lines = [_case_source(case), "import jax, jax.numpy as jnp, otb_spec, otb_jax", _import_line(target_spec),
                 f"jax.config.update('jax_enable_x64', {case.dtype == 'float64'})",
                 f"a = lambda x: None if x is None else jnp.asarray(x).astype({case.dtype!r})"]
        if kind == "sum-pi-squared":
            lines.append("got = target(a(logits))")
        else:
            lines.append("ids, count = otb_jax.segment_ids(group_ids)")
            lines.append(f"got = target(a(rewards), a(response_mask), ids, count, a(log_probs), a(sum_pi_squared), "
                         f"is_weights=a(is_weights), epsilon=epsilon{_option_keywords(kind)})")
        lines.append(_reference_line(case))
        lines.append(_difference_line(case, *_ARRAY_OUTPUTS))
        return "\n".join(lines)

    def describe_call(case: Case) -> str:
        text = _described_call(case, {"group_ids": "segment_ids"}, lambda a, dtype: _Shown("Array", a, dtype,
                                                                                          str(placement)),
                               lambda ids: _Shown("Array", ids, "int32", str(placement)))
        if case.kind == "sum-pi-squared":
            return text
        return text.replace(", log_probs=", f", num_segments={len({repr(g) for g in case.group_ids.tolist()})}, "
                                            "log_probs=", 1)

    return Subject(f"{target_spec} (jax convention, {placement})", _OTB_KINDS + ("sum-pi-squared",),
                   str(placement), run, snippet, _signature_check(target, 6, "is_weights"), describe_call=describe_call)


for _convention in (
    Convention("verl", "verl 0.9.1: torch tensors, NumPy index, returns (advantages, returns); fused kernels: "
               "f(hidden, weight, token_ids, temperature=τ), gradients by torch autograd",
               ("otb", "tir-otb", "sum-pi-squared", FUSED), _verl),
    Convention("numpy", "the reference's signature on NumPy arrays (fused kernels: values only)",
               _OTB_KINDS + ("sum-pi-squared", FUSED), _numpy),
    Convention("grouped", "contiguous equal-size groups as [G, N, T] NumPy arrays, no ids",
               _OTB_KINDS,
               lambda target, spec, kind, device: _numpy(target, spec, kind, device, grouped=True)),
    Convention("jax", "jax.Array inputs with integer segment ids and a static segment count (fused kernels: "
               "gradients by jax.vjp)", _OTB_KINDS + ("sum-pi-squared", FUSED), _jax),
):
    register_convention(_convention)


# ----------------------------------------------------------------------------------------------------------------------
# adapters

_ADAPTER_METHODS = _REFERENCE_FUNCTIONS              # the protocol's methods carry the reference's names
_ADAPTER_MEMBERS = ("name", "device", "asarray", "to_numpy", "segments", "compute_dtype")


def adapter_subject(adapter: Any) -> Subject:
    """A subject running a port through the adapter protocol (``otb_spec.adapters``) — every kind it implements.

    Outputs may be in any floating dtype at least as precise as the input (the protocol does not promise the input's
    dtype); the tolerance uses the precision the adapter says it accumulates in (``adapter.compute_dtype``)."""
    name = getattr(adapter, "name", type(adapter).__name__)

    def host(value: Any) -> tuple[np.ndarray, str]:
        dtype = str(getattr(value, "dtype", "")).replace("torch.", "")
        return np.asarray(adapter.to_numpy(value), dtype=np.float64), dtype

    def run(case: Case) -> Outcome:
        names = ("logits",) if case.kind == "sum-pi-squared" else (
            "rewards", "response_mask", "log_probs", "sum_pi_squared", "is_weights")
        arrays = {key: adapter.asarray(np.array(getattr(case, key), copy=True), case.dtype) for key in names
                  if getattr(case, key) is not None}
        before = {key: np.array(adapter.to_numpy(value), copy=True) for key, value in arrays.items()}
        if case.kind == "sum-pi-squared":
            results = (("sum_pi_squared", adapter.sum_pi_squared(arrays["logits"])),)
        else:
            keywords = {"is_weights": arrays.get("is_weights"), "epsilon": case.epsilon,
                        **_align_options(case.kind, always=True)}
            if case.kind not in LEAVE_ONE_OUT_KINDS:
                keywords["handle_zero_tail"] = case.handle_zero_tail
            results = tuple(zip(("advantages", "returns"), getattr(adapter, _ADAPTER_METHODS[case.kind])(
                arrays["rewards"], arrays["response_mask"], adapter.segments(np.array(case.group_ids, copy=True)),
                arrays["log_probs"],
                arrays["sum_pi_squared"], **keywords)))
        outputs, dtypes, devices = {}, {}, set()
        for key, value in results:
            outputs[key], dtypes[key] = host(value)
            devices.add(_device_of(value, adapter.device))
        mutated = [key for key, value in arrays.items() if changed(before[key], np.asarray(adapter.to_numpy(value)))]
        return Outcome(outputs, dtypes, devices, {str(adapter.device)}, mutated)

    def snippet(case: Case) -> str:
        return "\n".join([
            _case_source(case),
            "import otb_spec",
            "from otb_spec.adapters import load_adapter",
            "from otb_spec.conformance import Case, adapter_subject",
            f"case = Case({case.kind!r}, {case.name!r}, {case.dtype!r}"
            + ("" if case.kind == "sum-pi-squared" else
               ", rewards, response_mask, group_ids, log_probs, sum_pi_squared, is_weights, "
               "handle_zero_tail, epsilon") + (", logits=logits)" if case.kind == "sum-pi-squared" else ")"),
            f"got = adapter_subject(load_adapter({name!r})).run(case).outputs",
            _reference_line(case),
            _difference_line(case, "got['advantages']", "got['returns']", "got['sum_pi_squared']"),
        ])

    def signature_problem(kind: str) -> str | None:
        missing = [member for member in _ADAPTER_MEMBERS if not hasattr(adapter, member)]
        if not callable(getattr(adapter, _ADAPTER_METHODS[kind], None)):
            missing.append(_ADAPTER_METHODS[kind])
        return f"adapter lacks {', '.join(missing)} (see otb_spec.adapters.Adapter)" if missing else None

    kinds = tuple(kind for kind, method in _ADAPTER_METHODS.items() if callable(getattr(adapter, method, None)))
    def describe_call(case: Case) -> str:
        method = _ADAPTER_METHODS[case.kind]
        return f"{name}.{method}" + _described_call(
            case, {"group_ids": "segments"}, lambda a, dtype: _Shown("array", a, dtype, str(adapter.device)),
            lambda ids: f"adapter.segments(ndarray[{len(ids)}])", align_always=True)

    return Subject(f"adapter {name}", kinds, str(getattr(adapter, "device", "?")), run, snippet, signature_problem,
                   dtype_rule="at-least", compute_dtype=adapter.compute_dtype, describe_call=describe_call)


def _device_of(value: Any, default: str) -> str:
    device = getattr(value, "device", None)
    if device is not None and not callable(device):
        return str(device)
    devices = getattr(value, "devices", None)
    if callable(devices):
        return str(next(iter(devices())))
    return str(default)
