"""The fused-token-statistics kind under the ``verl`` (torch), ``numpy`` and ``jax`` conventions: how a fused kernel is
called, how its gradients are taken, and the programs that reproduce a call.

Every convention calls ``target(hidden, weight, token_ids, temperature=τ)`` with hidden [N, H] or [B, T, H], the LM
head weight [V, H] (one row per token, as ``torch.nn.Linear`` stores it), integer ids [N] or [B, T] and τ as a Python
float, and reads ``(log_probs, entropy)``, ``(log_probs, entropy, sum_pi_squared)`` or an object with those attributes
(``sum_pi_squared`` may be absent or None: it is then not checked). The gradients are those of
Σ g_lp·log π + g_H·H for the case's cotangents (g_lp, g_H):

* ``verl`` — torch tensors on the device, hidden and weight leaves with ``requires_grad=True``, ids int64;
  ``torch.autograd.grad((log_probs, entropy), (hidden, weight), (g_lp, g_H))`` — verl's ``FusedLinearForPPO`` is a
  ``torch.nn.Module`` class taking (hidden_states, vocab_weights, input_ids, temperature);
* ``jax`` — ``jax.Array`` inputs (float64 under ``jax.enable_x64``); ``jax.vjp`` of (hidden, weight) ↦ the outputs,
  pulled back with (g_lp, g_H) and a zero cotangent for Σπ²;
* ``numpy`` — NumPy arrays; values only (no automatic differentiation), and the report says so.

The cotangents are multiples of 1/64 in [−1, 1], so casting them to the dtype of the output they belong to is exact.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import numpy as np

from otb_spec.conformance._cases import Case
from otb_spec.conformance._subjects import (Outcome, Subject, _bind_problem, _case_source, _import_line, _jax_device,
                                            _jax_placement, _jax_put, _numpy_dtype, _outcome, _Shown, _torch,
                                            _torch_dtype, changed)

__all__: list[str] = []

_CALL = "target(hidden, weight, token_ids, temperature=τ)"
_OUTPUT_RULE = ("reads (log_probs, entropy[, sum_pi_squared]) or attributes of those names; Σπ² is checked where "
                "returned")


def statistics(result: Any) -> list[tuple[str, Any]]:
    """[(name, value)] of log_probs, entropy and, if given, sum_pi_squared from what a fused kernel returned."""
    if hasattr(result, "log_probs") and hasattr(result, "entropy"):
        items = [("log_probs", result.log_probs), ("entropy", result.entropy)]
        spp = getattr(result, "sum_pi_squared", None)
    elif isinstance(result, (tuple, list)) and len(result) in (2, 3):
        items = [("log_probs", result[0]), ("entropy", result[1])]
        spp = result[2] if len(result) == 3 else None
    else:
        raise TypeError(f"expected (log_probs, entropy) or (log_probs, entropy, sum_pi_squared), got "
                        f"{type(result).__name__}" + (f" of length {len(result)}" if isinstance(result, (tuple, list))
                                                      else ""))
    if spp is not None:
        items.append(("sum_pi_squared", spp))
    return items


def _signature_problem(target: Callable) -> Callable[[str], str | None]:
    """An ``nn.Module`` instance is bound through its ``forward`` (its ``__call__`` takes anything)."""
    forward = getattr(target, "forward", None)
    shown = forward if callable(forward) and not inspect.isfunction(target) and not inspect.ismethod(target) \
        else target
    return lambda kind: _bind_problem(shown, 3, {"temperature": 1.0})


def _shape_of(value: Any) -> tuple[int, ...] | None:
    shape = getattr(value, "shape", None)
    return None if shape is None else tuple(shape)


def _describe(case: Case, kind_of_array: str, device: str | None) -> str:
    return (f"(hidden={_Shown(kind_of_array, case.hidden, case.dtype, device)}, "
            f"weight={_Shown(kind_of_array, case.weight, case.dtype, device)}, "
            f"token_ids={_Shown(kind_of_array, case.token_ids, 'int64', device)}, temperature={case.temperature!r})")


def _reference_lines(with_gradients: bool) -> list[str]:
    lines = ["expected = otb_spec.token_statistics_from_hidden(hidden, weight, token_ids, temperature=temperature)"]
    if with_gradients:
        lines.append("gradients = otb_spec.token_statistics_vjp(hidden, weight, token_ids, log_probs_cotangent, "
                     "entropy_cotangent, temperature=temperature)")
    return lines


def _difference_line(host: str, with_gradients: bool) -> str:
    """``host`` formats an expression into float64 NumPy."""
    parts = [f'"log_probs", abs({host.format("got_log_probs")} - expected.log_probs).max()',
             f'"entropy", abs({host.format("got_entropy")} - expected.entropy).max()']
    if with_gradients:
        parts += [f'"grad_hidden", abs({host.format("grad_hidden")} - gradients.hidden).max()',
                  f'"grad_weight", abs({host.format("grad_weight")} - gradients.weight).max()']
    return f'print("max |got - expected|:", {", ".join(parts)})'


_UNPACK = ("got = target(h, w, ids, temperature=temperature)",
           "got_log_probs, got_entropy = (got.log_probs, got.entropy) if hasattr(got, 'log_probs') else got[:2]")


# ----------------------------------------------------------------------------------------------------------------------
# verl: torch


def _gradients_by_backward(torch: Any, outputs: tuple, cotangents: list, leaves: tuple) -> tuple | None:
    """The gradients as a trainer's ``loss.backward()`` forms them — ``torch.autograd.backward(outputs, cotangents)``,
    read from the leaves' ``.grad`` — for a graph that refuses ``torch.autograd.grad`` (a reentrant
    ``torch.utils.checkpoint``, which only supports ``backward``); None where that fails too or leaves a gradient
    unset."""
    try:
        torch.autograd.backward(outputs, cotangents)
    except RuntimeError:
        return None
    grads = tuple(leaf.grad for leaf in leaves)
    return None if any(grad is None for grad in grads) else grads


def torch_subject(target: Callable, target_spec: str, device: str) -> Subject:
    torch = _torch()
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device='cuda' (--device cuda): torch sees no CUDA device on this machine")

    def tensor(array: np.ndarray, dtype: str):
        host = np.array(array, dtype=np.float32 if dtype != "float64" else np.float64, copy=True)
        return torch.from_numpy(host).to(device=device, dtype=_torch_dtype(dtype))

    def run(case: Case) -> Outcome:
        hidden = tensor(case.hidden, case.dtype).requires_grad_(True)
        weight = tensor(case.weight, case.dtype).requires_grad_(True)
        ids = torch.as_tensor(np.array(case.token_ids, dtype=np.int64, copy=True), device=device)
        inputs = {"hidden": hidden, "weight": weight, "token_ids": ids}
        before = {name: value.detach().clone() for name, value in inputs.items()}
        results = statistics(target(hidden, weight, ids, temperature=case.temperature))
        log_probs, entropy = results[0][1], results[1][1]
        lead = tuple(case.token_ids.shape)
        if _shape_of(log_probs) == lead and _shape_of(entropy) == lead:     # else the shape check tells
            cotangents = [torch.from_numpy(np.array(g, dtype=np.float64)).to(device=device, dtype=out.dtype)
                          for g, out in ((case.log_probs_cotangent, log_probs), (case.entropy_cotangent, entropy))]
            try:
                grads = torch.autograd.grad((log_probs, entropy), (hidden, weight), cotangents)
            except RuntimeError as exc:
                grads = _gradients_by_backward(torch, (log_probs, entropy), cotangents, (hidden, weight))
                if grads is None:
                    raise RuntimeError("torch.autograd.grad of (log_probs, entropy) with respect to (hidden, weight) "
                                       f"failed — the statistics must carry gradients: {exc}") from exc
            results += [("grad_hidden", grads[0]), ("grad_weight", grads[1])]
        outcome = _outcome(tuple(results), {str(hidden.device)})
        outcome.mutated = [name for name, value in inputs.items() if changed(before[name], value)]
        return outcome

    def snippet(case: Case) -> str:
        host = "np.asarray({}.detach().double().cpu())"
        return "\n".join([
            _case_source(case), "import torch, otb_spec", _import_line(target_spec),
            f"h = torch.tensor(hidden, device={device!r}).to(torch.{case.dtype}).requires_grad_()",
            f"w = torch.tensor(weight, device={device!r}).to(torch.{case.dtype}).requires_grad_()",
            f"ids = torch.as_tensor(token_ids, device={device!r})", *_UNPACK,
            "# the gradients as loss.backward() forms them (also where a reentrant checkpoint refuses .grad())",
            "torch.autograd.backward((got_log_probs, got_entropy), "
            f"(torch.tensor(log_probs_cotangent, device={device!r}).to(got_log_probs.dtype), "
            f"torch.tensor(entropy_cotangent, device={device!r}).to(got_entropy.dtype)))",
            "grad_hidden, grad_weight = h.grad, w.grad",
            "hidden, weight = h.detach().double().cpu().numpy(), w.detach().double().cpu().numpy()  # as given",
            *_reference_lines(True), _difference_line(host, True)])

    return Subject(f"{target_spec} (verl convention, {device})", ("fused-token-statistics",), device, run, snippet,
                   _signature_problem(target), dtype_rule="at-least",
                   describe_call=lambda case: _describe(case, "Tensor", device),
                   notes=(f"called as:   {_CALL} with torch tensors on {device}; {_OUTPUT_RULE}",
                          "gradients:   torch.autograd.grad((log_probs, entropy), (hidden, weight), (g_lp, g_H)) — the "
                          "gradients of Σ g_lp·log π + g_H·H for the case's cotangents (torch.autograd.backward, "
                          "read from .grad, where the graph refuses .grad(): a reentrant torch.utils.checkpoint)"))


# ----------------------------------------------------------------------------------------------------------------------
# numpy: values only


def numpy_subject(target: Callable, target_spec: str) -> Subject:
    def array(values: np.ndarray, dtype: str) -> np.ndarray:
        return np.asarray(values, dtype=np.float32 if dtype != "float64" else np.float64).astype(_numpy_dtype(dtype))

    def run(case: Case) -> Outcome:
        inputs = {"hidden": array(case.hidden, case.dtype), "weight": array(case.weight, case.dtype),
                  "token_ids": np.array(case.token_ids, dtype=np.int64, copy=True)}
        before = {name: value.copy() for name, value in inputs.items()}
        results = statistics(target(inputs["hidden"], inputs["weight"], inputs["token_ids"],
                                    temperature=case.temperature))
        outcome = _outcome(tuple(results), {"cpu"})
        outcome.mutated = [name for name, value in inputs.items() if changed(before[name], value)]
        return outcome

    def snippet(case: Case) -> str:
        cast = "" if case.dtype in ("float64", "float32") else f"  # delivered as {case.dtype}"
        return "\n".join([
            _case_source(case), "import otb_spec", _import_line(target_spec),
            f"h, w, ids = hidden, weight, token_ids{cast}", *_UNPACK,
            *_reference_lines(False), _difference_line("np.asarray({}, dtype=np.float64)", False)])

    return Subject(f"{target_spec} (numpy convention)", ("fused-token-statistics",), "cpu", run, snippet,
                   _signature_problem(target), supports_dtype=lambda dtype: _numpy_dtype(dtype) is not None,
                   dtype_rule="at-least", describe_call=lambda case: _describe(case, "ndarray", None),
                   notes=(f"called as:   {_CALL} with NumPy arrays; {_OUTPUT_RULE}",
                          "gradients:   NOT CHECKED — the numpy convention cannot differentiate the target: values "
                          "only (check a differentiable port under --convention verl or jax)"))


# ----------------------------------------------------------------------------------------------------------------------
# jax


def jax_subject(target: Callable, target_spec: str, device: str) -> Subject:
    import jax
    import jax.numpy as jnp

    placement = _jax_placement(device)

    def array(values: np.ndarray, dtype: str):
        return _jax_put(values, dtype, placement)

    def run(case: Case) -> Outcome:
        with jax.enable_x64(case.dtype == "float64"):
            hidden, weight = array(case.hidden, case.dtype), array(case.weight, case.dtype)
            ids = jax.device_put(jnp.asarray(np.asarray(case.token_ids)), placement)
            names: list[str] = []

            def call(h, w):
                items = statistics(target(h, w, ids, temperature=case.temperature))
                names[:] = [name for name, _ in items]
                return tuple(value for _, value in items)

            values, pullback = jax.vjp(call, hidden, weight)
            results = list(zip(names, values))
            lead = tuple(case.token_ids.shape)
            if _shape_of(values[0]) == lead and _shape_of(values[1]) == lead:
                cotangents = (jnp.asarray(case.log_probs_cotangent).astype(values[0].dtype),
                              jnp.asarray(case.entropy_cotangent).astype(values[1].dtype)) + tuple(
                    jnp.zeros_like(value) for value in values[2:])
                grad_hidden, grad_weight = pullback(cotangents)
                results += [("grad_hidden", grad_hidden), ("grad_weight", grad_weight)]
            return _outcome(tuple(results), {_jax_device(hidden)})

    def snippet(case: Case) -> str:
        host = "np.asarray({}, dtype=np.float64)"
        return "\n".join([
            _case_source(case), "import jax, jax.numpy as jnp, otb_spec", _import_line(target_spec),
            f"jax.config.update('jax_enable_x64', {case.dtype == 'float64'})",
            f"h, w, ids = jnp.asarray(hidden).astype({case.dtype!r}), jnp.asarray(weight).astype({case.dtype!r}), "
            "jnp.asarray(token_ids)",
            "def call(h, w):",
            "    got = target(h, w, ids, temperature=temperature)",
            "    return (got.log_probs, got.entropy) if hasattr(got, 'log_probs') else tuple(got[:2])",
            "(got_log_probs, got_entropy), pullback = jax.vjp(call, h, w)",
            "grad_hidden, grad_weight = pullback((jnp.asarray(log_probs_cotangent).astype(got_log_probs.dtype), "
            "jnp.asarray(entropy_cotangent).astype(got_entropy.dtype)))",
            "hidden, weight = np.asarray(h, dtype=np.float64), np.asarray(w, dtype=np.float64)  # as given",
            *_reference_lines(True), _difference_line(host, True)])

    return Subject(f"{target_spec} (jax convention, {placement})", ("fused-token-statistics",), str(placement), run,
                   snippet, _signature_problem(target), dtype_rule="at-least", fixed_shapes=True,
                   describe_call=lambda case: _describe(case, "Array", str(placement)),
                   notes=(f"called as:   {_CALL} with jax.Array inputs on {placement}; {_OUTPUT_RULE}",
                          "gradients:   jax.vjp over (hidden, weight), pulled back with (g_lp, g_H) and 0 for Σπ² — "
                          "the gradients of Σ g_lp·log π + g_H·H; generated cases use one shape (hidden [2, 5, 8], "
                          "V = 23), so a jitted target compiles once per dtype"))


def subject_for(convention: str, target: Callable, target_spec: str, device: str) -> Subject:
    if convention == "verl":
        return torch_subject(target, target_spec, device)
    if convention == "jax":
        return jax_subject(target, target_spec, device)
    return numpy_subject(target, target_spec)
