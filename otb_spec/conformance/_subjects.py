"""What the checks see of an implementation — :class:`Subject` and :class:`Outcome` — and the helpers that the
calling conventions (``_conventions``) and the fused-token-statistics subjects (``_fused``) share: moving values to the
host, dtype names, call descriptions and reproducing snippets. Split out so neither of those modules imports the other
in a cycle."""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from otb_spec.conformance._cases import Case, compute_dtype_for

__all__ = ["Outcome", "Subject", "changed"]


@dataclass
class Outcome:
    """What one call produced: float64 outputs, their dtypes and devices, the input devices, mutated inputs."""

    outputs: dict[str, np.ndarray]
    output_dtypes: dict[str, str]
    output_devices: set[str] = field(default_factory=set)
    input_devices: set[str] = field(default_factory=set)
    mutated: list[str] = field(default_factory=list)


def changed(before: Any, after: Any) -> bool:
    """True if an input's value after the call is not bit for bit its value before (shape, dtype or any bit; NaN
    compares equal to the same NaN): what "inputs unchanged" means, checked on every call. NumPy arrays or torch
    tensors (``before`` a copy made before the call)."""
    if isinstance(before, np.ndarray):
        after = np.asarray(after)
        if before.shape != after.shape or before.dtype != after.dtype:
            return True
        if before.dtype == object:                   # ids as Python objects: compared by value
            return not np.array_equal(before, after)
        return before.tobytes() != after.tobytes()
    torch = sys.modules["torch"]                     # a tensor: torch is loaded
    after = after.detach()
    if before.shape != after.shape or before.dtype != after.dtype:
        return True
    raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731 — the bits, whatever the dtype
    return not torch.equal(raw(before), raw(after))


@dataclass
class Subject:
    """An implementation as the checks see it.

    Attributes:
      name: shown in reports (target and convention).
      kinds: the kinds it can be checked for.
      device: where its inputs are placed.
      run: runs a case → :class:`Outcome` (raises whatever the implementation raises).
      snippet: a copy-pasteable program reproducing a case's call and the reference's answer.
      signature_problem: ``kind → None`` or why the callable cannot be called as the convention requires.
      signature_note: ``kind → None`` or a warning from the signature layer: the callable is checked, but not called
        quite as the convention's trainer would call it (and says how it is called instead).
      equal_groups: only contiguous equal-size groups can be expressed (a [G, N, T] layout).
      supports_dtype: whether the convention can deliver inputs of a dtype (NumPy has no bfloat16 without ml_dtypes).
      dtype_rule: ``"same"`` — outputs in the input dtype; ``"at-least"`` — a floating dtype at least as precise.
      compute_dtype: the precision it accumulates in for an input dtype (decides the tolerance).
      expressible: ``case → None`` or why this subject cannot take that case (the check is skipped with the reason).
      describe_call: ``case → text`` naming the arguments the target is called with (types, shapes, dtypes, devices
        and options), shown when the target raises.
      working_dtype: the working precision the tolerance assumes for an input dtype (fused kind: the precision of the
        logits and per-token values; default the input's dtype).
      fixed_shapes: generated cases of the fused kind use one shape (a target that compiles per shape compiles once
        per dtype).
      notes: lines for the report's header saying how the subject is called and what is checked (e.g. how the
        gradients are taken, or that they are not).
      mask_dtype: the dtype ``response_mask`` reaches the target in, for a case (default: the case's dtype; the
        ``verl`` convention: int64, as verl's trainer holds it).
    """

    name: str
    kinds: tuple[str, ...]
    device: str
    run: Callable[[Case], Outcome]
    snippet: Callable[[Case], str]
    signature_problem: Callable[[str], str | None] = lambda kind: None
    signature_note: Callable[[str], str | None] = lambda kind: None
    equal_groups: bool = False
    supports_dtype: Callable[[str], bool] = lambda dtype: True
    dtype_rule: str = "same"
    compute_dtype: Callable[[str], str] = compute_dtype_for
    expressible: Callable[[Case], str | None] = lambda case: None
    describe_call: Callable[[Case], str] = lambda case: ""
    working_dtype: Callable[[str], str] = lambda dtype: dtype
    fixed_shapes: bool = False
    notes: tuple[str, ...] = ()
    mask_dtype: Callable[[Case], str] = lambda case: case.dtype


def _bind_problem(target: Callable, args: int, keywords: dict) -> str | None:
    try:
        signature = inspect.signature(target)
    except (TypeError, ValueError):
        return None                                         # builtins without a signature: the call will tell
    try:
        signature.bind(*range(args), **keywords)
    except TypeError as exc:
        shown = ["·"] * args + [f"{k}=…" for k in keywords]
        return f"cannot be called as f({', '.join(shown)}): {exc}"
    return None


def _literal(name: str, array: np.ndarray | None, dtype: str) -> str:
    if array is None:
        return f"{name} = None"
    if array.dtype == object or array.dtype.kind in "USO":
        return f"{name} = np.array({array.tolist()!r}, dtype=object)"
    if name in ("group_ids", "token_ids"):
        return f"{name} = np.array({array.tolist()!r}, dtype=np.{array.dtype.name})"
    numpy_dtype = "float64" if dtype == "float64" or name.endswith("_cotangent") else "float32"
    return f"{name} = np.array({np.asarray(array, dtype=np.float64).tolist()!r}, dtype=np.{numpy_dtype})"


_FUSED_INPUTS = ("hidden", "weight", "token_ids", "log_probs_cotangent", "entropy_cotangent")


def _case_source(case: Case) -> str:
    """Code that builds the case's arrays: literals for small cases, the library for large ones."""
    arrays = {"sum-pi-squared": ("logits",), "fused-token-statistics": _FUSED_INPUTS}.get(case.kind, (
        "rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared", "is_weights"))
    size = sum(np.size(getattr(case, name)) for name in arrays if getattr(case, name) is not None)
    options = {"sum-pi-squared": None,
               "fused-token-statistics": ("temperature", f"{case.temperature!r}", "case.temperature")}.get(
        case.kind, ("handle_zero_tail, epsilon", f"{case.handle_zero_tail!r}, {case.epsilon!r}",
                    "case.handle_zero_tail, case.epsilon"))
    if case.name == "generated" or size <= 400:
        lines = ["import numpy as np"] + [_literal(name, getattr(case, name), case.dtype) for name in arrays]
        if options:
            lines.append(f"{options[0]} = {options[1]}")
        return "\n".join(lines)
    lines = ["import numpy as np",
             "from otb_spec.conformance import find_case",
             f"case = find_case({case.kind!r}, {case.name!r}, {case.dtype!r})"]
    lines += [f"{name} = case.{name}" for name in arrays]
    if options:
        lines.append(f"{options[0]} = {options[2]}")
    return "\n".join(lines)


def _import_line(target_spec: str) -> str:
    """The line binding ``target``: an import for ``module:name`` / ``file.py:name`` (``name`` may be dotted; a
    trailing ``()`` — a class the verifier instantiated — instantiates it with no arguments)."""
    if target_spec.endswith("()"):
        return _import_line(target_spec[:-2]) + "; target = target()"
    module, _, attribute = target_spec.rpartition(":")
    if "<" in attribute or not module:               # a lambda or nested function passed as an object
        return f"target = ...  # bind `target` to the function you passed to verify() ({target_spec})"
    if module.endswith(".py"):
        return (f"import importlib.util; spec = importlib.util.spec_from_file_location('target', {module!r}); "
                f"target_module = importlib.util.module_from_spec(spec); spec.loader.exec_module(target_module); "
                f"target = target_module.{attribute}")
    first, _, rest = attribute.partition(".")
    return f"from {module} import {first} as target" + (f"; target = target.{rest}" if rest else "")


class _Shown:
    """Stands for an argument in a call description: its type name, shape, dtype and device."""

    def __init__(self, type_name: str, array: np.ndarray, dtype: str, device: str | None = None):
        self.shape, self.dtype, self.device, self.type_name = tuple(np.shape(array)), dtype, device, type_name

    def __str__(self) -> str:
        where = f" on {self.device}" if self.device else ""
        return f"{self.type_name}[{', '.join(str(n) for n in self.shape)}] {self.dtype}{where}"


def _torch():
    import torch  # the verl convention needs torch; imported only when it is used

    return torch


def _torch_dtype(dtype: str):
    torch = _torch()
    return {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
            "float16": torch.float16}[dtype]


def _to_host(value: Any) -> tuple[np.ndarray, str, str]:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        dtype = str(value.dtype).replace("torch.", "")
        host = value.detach().cpu()
        if host.dtype in (torch.bfloat16, torch.float16):
            host = host.float()
        return host.numpy().astype(np.float64), dtype, str(value.device)
    jax = sys.modules.get("jax")
    if jax is not None and isinstance(value, jax.Array):
        host = np.asarray(value)
        dtype = host.dtype.name
        devices = getattr(value, "devices", None)
        device = str(next(iter(devices()))) if callable(devices) else "jax"
        return host.astype(np.float64), dtype, device
    host = np.asarray(value)
    return host.astype(np.float64), host.dtype.name, "cpu"


def _outcome(results: tuple, input_devices: set[str]) -> Outcome:
    outputs, dtypes, devices = {}, {}, set()
    for name, value in results:
        outputs[name], dtypes[name], where = _to_host(value)
        devices.add(where)
    return Outcome(outputs, dtypes, devices, input_devices)


def _numpy_dtype(dtype: str):
    if dtype in ("float64", "float32", "float16"):
        return np.dtype(dtype)
    ml_dtypes = sys.modules.get("ml_dtypes")
    if ml_dtypes is None:
        try:
            import ml_dtypes  # optional: NumPy has no bfloat16 of its own
        except ImportError:
            return None
    return np.dtype(ml_dtypes.bfloat16)


def _jax_device(value: Any) -> str:
    devices = getattr(value, "devices", None)
    return str(next(iter(devices()))) if callable(devices) else "jax"


def _jax_placement(device: str) -> Any:
    """The JAX device a ``--device`` name means (``cuda``/``gpu`` → JAX's gpu platform), or a RuntimeError saying so."""
    import jax

    platform = "gpu" if device.startswith(("cuda", "gpu")) else device
    try:
        return jax.devices(platform)[0]
    except RuntimeError as exc:
        raise RuntimeError(f"--device {device}: JAX has no {platform} device here ({exc})") from None


def _jax_put(values: np.ndarray, dtype: str, placement: Any) -> Any:
    """A case's array as a ``jax.Array`` of ``dtype`` on ``placement`` (through float32, or float64 for float64)."""
    import jax
    import jax.numpy as jnp

    host = np.asarray(values, dtype=np.float32 if dtype != "float64" else np.float64)
    return jax.device_put(jnp.asarray(host).astype(dtype), placement)
