"""The adapter protocol: what a framework port implements so that the conformance suite runs over it.

An adapter is conversion + dispatch: it moves NumPy arrays into the framework (on its device, in a given dtype),
calls the port's functions, and hands results back. The math stays in the port; the reference checks it.

Minimal interface (``Adapter``):

* ``name`` — e.g. ``"torch-cpu"``; ``device`` — where its arrays live;
* ``asarray(array, dtype)`` — NumPy → framework array (dtype name: ``"float32"``, ``"float64"``, ``"bfloat16"``,
  ``"float16"``, or an integer/bool dtype name for masks and ids);
* ``to_numpy(array)`` — framework array → NumPy (float64 or float32);
* ``segments(group_ids)`` — the port's representation of the prompt groups (built once per batch);
* ``compute_dtype(input_dtype)`` — the dtype the port accumulates in for that input dtype (decides the tolerance);
* the functions, taking framework arrays and returning framework arrays:

  - ``optimal_token_baseline(rewards, response_mask, segments, log_probs, sum_pi_squared, *, is_weights,
    handle_zero_tail, epsilon) → (advantages, returns)``
  - ``multi_turn_optimal_token_baseline(...)`` — same signature
  - ``leave_one_out_token_baseline(rewards, response_mask, segments, log_probs, sum_pi_squared, *, is_weights, align,
    epsilon) → (advantages, returns)``
  - ``sum_pi_squared(logits) → Σπ²``

* optional: ``token_statistics_from_logits(logits, token_ids) → (log_probs, entropy, Σπ²)`` — checked when present by
  the shared property suite (``tests/test_adapters.py`` in a checkout), not by ``verify_adapter``; to verify it, call
  it on h·Wᵀ/τ from a ``fused-token-statistics`` target (docs/porting.md).

Registering a port: expose a factory ``make_adapter(**options) → Adapter`` and either call
:func:`register_adapter` or declare an entry point in the group ``otb_spec.adapters``::

    [project.entry-points."otb_spec.adapters"]
    mine = "my_package.otb_adapter:make_adapter"

:func:`available_adapters` lists the built-in ports whose framework is installed (torch, jax) plus registered ones;
:func:`load_adapter` builds one. docs/porting.md walks through writing a port.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, Protocol, runtime_checkable

__all__ = ["Adapter", "AdapterSpec", "ReferenceAdapter", "register_adapter", "available_adapters", "load_adapter",
           "REQUIRED_FUNCTIONS"]

REQUIRED_FUNCTIONS = ("optimal_token_baseline", "multi_turn_optimal_token_baseline", "leave_one_out_token_baseline",
                      "sum_pi_squared")


@runtime_checkable
class Adapter(Protocol):
    """The minimal interface of a framework port (see the module docstring)."""

    name: str
    device: str

    def asarray(self, array: Any, dtype: str) -> Any: ...

    def to_numpy(self, array: Any) -> Any: ...

    def segments(self, group_ids: Any) -> Any: ...

    def compute_dtype(self, input_dtype: str) -> str: ...

    def optimal_token_baseline(self, rewards: Any, response_mask: Any, segments: Any, log_probs: Any,
                               sum_pi_squared: Any, *, is_weights: Any = None, handle_zero_tail: bool = True,
                               epsilon: float = 1e-8) -> tuple[Any, Any]: ...

    def multi_turn_optimal_token_baseline(self, rewards: Any, response_mask: Any, segments: Any, log_probs: Any,
                                          sum_pi_squared: Any, *, is_weights: Any = None,
                                          handle_zero_tail: bool = True, epsilon: float = 1e-8) -> tuple[Any, Any]: ...

    def leave_one_out_token_baseline(self, rewards: Any, response_mask: Any, segments: Any, log_probs: Any,
                                     sum_pi_squared: Any, *, is_weights: Any = None, align: str = "position",
                                     epsilon: float = 1e-8) -> tuple[Any, Any]: ...

    def sum_pi_squared(self, logits: Any) -> Any: ...


class ReferenceAdapter:
    """The NumPy reference itself behind the adapter interface (``"numpy-reference"``): the suite's yardstick, and an
    example of the interface. Arrays are NumPy arrays on the host; results are float64."""

    name = "numpy-reference"
    device = "cpu"

    def asarray(self, array: Any, dtype: str) -> Any:
        """The values in ``dtype`` (bfloat16 via ml_dtypes when installed, else float32 holding the rounded values):
        the reference computes in float64 whatever it receives, and judges input ranges with the slack of the dtype
        it received (``input_range_slack``)."""
        import numpy as np

        if dtype == "bfloat16":
            try:
                import ml_dtypes
            except ImportError:
                return np.asarray(array, dtype=np.float32)
            return np.asarray(array, dtype=np.float32).astype(ml_dtypes.bfloat16)
        return np.asarray(array).astype(dtype)

    def to_numpy(self, array: Any) -> Any:
        return array

    def segments(self, group_ids: Any) -> Any:
        return group_ids

    def compute_dtype(self, input_dtype: str) -> str:
        return "float64"

    def optimal_token_baseline(self, rewards, response_mask, segments, log_probs, sum_pi_squared, *,
                               is_weights=None, handle_zero_tail=True, epsilon=1e-8):
        from otb_spec.otb import optimal_token_baseline

        result = optimal_token_baseline(rewards, response_mask, segments, log_probs, sum_pi_squared,
                                        is_weights=is_weights, handle_zero_tail=handle_zero_tail, epsilon=epsilon)
        return result.advantages, result.returns

    def multi_turn_optimal_token_baseline(self, rewards, response_mask, segments, log_probs, sum_pi_squared, *,
                                          is_weights=None, handle_zero_tail=True, epsilon=1e-8):
        from otb_spec.otb import multi_turn_optimal_token_baseline

        result = multi_turn_optimal_token_baseline(rewards, response_mask, segments, log_probs, sum_pi_squared,
                                                   is_weights=is_weights, handle_zero_tail=handle_zero_tail,
                                                   epsilon=epsilon)
        return result.advantages, result.returns

    def leave_one_out_token_baseline(self, rewards, response_mask, segments, log_probs, sum_pi_squared, *,
                                     is_weights=None, align="position", epsilon=1e-8):
        from otb_spec.otb import leave_one_out_token_baseline

        result = leave_one_out_token_baseline(rewards, response_mask, segments, log_probs, sum_pi_squared,
                                              is_weights=is_weights, align=align, epsilon=epsilon)
        return result.advantages, result.returns

    def sum_pi_squared(self, logits: Any) -> Any:
        from otb_spec.proxy import sum_pi_squared

        return sum_pi_squared(logits)

    def token_statistics_from_logits(self, logits: Any, token_ids: Any) -> tuple:
        from otb_spec.proxy import token_statistics_from_logits

        return tuple(token_statistics_from_logits(logits, token_ids))


@dataclass(frozen=True)
class AdapterSpec:
    """A known adapter: how to tell whether it can run here, and how to build it.

    Attributes:
      name: registry key (e.g. ``"torch-cpu"``).
      factory: ``"module:callable"`` or a callable returning an :class:`Adapter`.
      requires: top-level modules that must be importable (checked without importing them).
      options: keyword arguments for the factory (e.g. ``{"device": "cuda"}``).
      probe: optional callable returning False when the adapter cannot run here (e.g. no GPU); it may import.
    """

    name: str
    factory: str | Callable[..., Any]
    requires: tuple[str, ...] = ()
    options: dict = field(default_factory=dict)
    probe: Callable[[], bool] | None = None

    def installed(self) -> bool:
        return all(importlib.util.find_spec(module) is not None for module in self.requires)

    def runnable(self) -> bool:
        return self.installed() and (self.probe is None or bool(self.probe()))

    def build(self, **overrides: Any) -> Adapter:
        factory = self.factory
        if isinstance(factory, str):
            module_name, _, attribute = factory.partition(":")
            factory = getattr(importlib.import_module(module_name), attribute)
        adapter = factory(**{**self.options, **overrides})
        missing = [name for name in REQUIRED_FUNCTIONS if not callable(getattr(adapter, name, None))]
        if missing:
            raise TypeError(f"adapter {self.name!r}: missing required function(s) {', '.join(missing)}")
        return adapter


def _cuda_available() -> bool:
    import torch  # the probe runs only when the adapter is asked for

    return bool(torch.cuda.is_available())


def _jax_gpu_available() -> bool:
    import jax

    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


_REGISTRY: dict[str, AdapterSpec] = {}


def register_adapter(spec: AdapterSpec) -> None:
    """Add (or replace) an adapter in the registry."""
    if not isinstance(spec, AdapterSpec):
        raise TypeError(f"spec: expected an AdapterSpec, got {type(spec).__name__}")
    _REGISTRY[spec.name] = spec


for _spec in (
    AdapterSpec("numpy-reference", ReferenceAdapter),
    AdapterSpec("torch-cpu", "otb_torch._adapter:make_adapter", ("torch", "otb_torch"), {"device": "cpu"}),
    AdapterSpec("torch-cpu-eager", "otb_torch._adapter:make_adapter", ("torch", "otb_torch"),
                {"device": "cpu", "eager": True}),
    AdapterSpec("torch-cpu-accelerator-blocks", "otb_torch._adapter:make_adapter", ("torch", "otb_torch"),
                {"device": "cpu", "accelerator_blocks": True}),
    AdapterSpec("torch-cpu-compiled", "otb_torch._adapter:make_adapter", ("torch", "otb_torch"),
                {"device": "cpu", "compiled": True}),
    AdapterSpec("torch-cpu-distributed", "otb_torch._adapter:make_adapter", ("torch", "otb_torch"),
                {"device": "cpu", "distributed": True}),
    AdapterSpec("torch-cuda", "otb_torch._adapter:make_adapter", ("torch", "otb_torch"), {"device": "cuda"},
                probe=_cuda_available),
    AdapterSpec("jax-cpu", "otb_jax._adapter:make_adapter", ("jax", "otb_jax"), {"platform": "cpu"}),
    AdapterSpec("jax-cpu-nojit", "otb_jax._adapter:make_adapter", ("jax", "otb_jax"),
                {"platform": "cpu", "jit": False}),
    AdapterSpec("jax-gpu", "otb_jax._adapter:make_adapter", ("jax", "otb_jax"), {"platform": "gpu"},
                probe=_jax_gpu_available),
):
    register_adapter(_spec)


def _entry_point_specs() -> list[AdapterSpec]:
    specs = []
    for entry in entry_points(group="otb_spec.adapters"):
        specs.append(AdapterSpec(entry.name, entry.value))
    return specs


def available_adapters(*, runnable_only: bool = True) -> list[str]:
    """Names of the registered adapters (and entry-point ones) that can run here (or are merely installed)."""
    for spec in _entry_point_specs():
        _REGISTRY.setdefault(spec.name, spec)
    check = AdapterSpec.runnable if runnable_only else AdapterSpec.installed
    return [name for name, spec in _REGISTRY.items() if check(spec)]


def load_adapter(name: str, **options: Any) -> Adapter:
    """Build the named adapter (``"torch-cpu"``, ``"jax-cpu"``, a registered or entry-point name)."""
    if name not in _REGISTRY:
        for spec in _entry_point_specs():
            _REGISTRY.setdefault(spec.name, spec)
    if name not in _REGISTRY:
        raise ValueError(f"name: unknown adapter {name!r}; known: {', '.join(_REGISTRY)} (an adapter registered with "
                         f"register_adapter is known in the process that registered it; for `otb-spec verify "
                         f"--adapter`, declare it as an entry point in the group 'otb_spec.adapters')")
    spec = _REGISTRY[name]
    if not spec.installed():
        raise ValueError(f"name: adapter {name!r} needs {', '.join(spec.requires)}, which is not installed")
    return spec.build(**options)
