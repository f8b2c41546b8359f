"""Conformance verifier: is a third-party OTB implementation right?

One call (or ``otb-spec verify``) runs layered checks against the reference::

    from otb_spec.conformance import verify
    report = verify("my_trainer.advantages:compute_optimal_token_baseline_advantage", "otb")   # verl convention
    print(report.to_text()); assert report.conformant

Layers (``LAYERS``): signature → structure (shapes, dtypes, devices, inputs unchanged, determinism) → golden cases →
Hypothesis-generated cases (shrunk to a minimal failing case) → special cases (long sequences, large or extreme
logits, bfloat16) → robustness (values no trainer produces at masked positions: warnings only). Tolerances are per
element, from the dtypes and the problem size (``otb_spec.tolerances``): a correct program in floating point passes.

The verdict (:attr:`Report.verdict`, the report's first line) is ``CONFORMANT``, ``CONFORMANT WITH N DOCUMENTED
DEVIATIONS`` or ``NOT CONFORMANT``. A documented deviation (``DEVIATIONS``) is a place where verl 0.9.1 itself differs
from the reference — by definition (ε = 0: 0/0 = NaN) or by a known verl defect (half-precision lengths); an
implementation that behaves exactly as verl does there is listed, not failed, unless ``strict=True``.

Calling conventions (``CONVENTIONS``; add one with :func:`register_convention`): ``verl`` (torch tensors, NumPy
``index``, returns ``(advantages, returns)`` — verl 0.9.1's functions), ``numpy`` (the reference's signature),
``grouped`` ([G, N, T] arrays of contiguous equal-size groups), ``jax`` (segment ids + a static count). Fused kernels
(kind ``fused-token-statistics``: log π, entropy and Σπ² from hidden states and the LM head, values and gradients)
are called ``f(hidden, weight, token_ids, temperature=τ)`` under ``verl`` (torch autograd), ``jax`` (``jax.vjp``) and
``numpy`` (values only). Ports written against the adapter protocol (``otb_spec.adapters``) are checked with
:func:`verify_adapter`.

For your own property tests: :func:`generated_cases` / :func:`golden_cases` / :func:`special_cases` give
:class:`Case` objects (inputs, options, ``case.expected()``, ``case.tolerances()``), and
:func:`assert_matches_reference` compares your outputs with the same rule ``verify`` uses. The pytest plugin
(``otb_spec.pytest_plugin``) wraps all of this in fixtures. docs/conformance.md has the details.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import time
from dataclasses import replace
from typing import Any, Callable, Iterable

from otb_spec.conformance._cases import (FUSED, GENERATED_PROFILES, KINDS, Case, compute_dtype_for, generated_cases,
                                         golden_cases, robustness_cases, special_cases)
from otb_spec.conformance._checks import (DEFAULT_TIMEOUT, LAYERS, SHRINK_BUDGET, STATUSES, CheckResult, Comparison,
                                          TargetTimeout, compare, read_skip_file, run_checks)
from otb_spec.conformance._deviations import DEVIATIONS, Deviation
from otb_spec.conformance._conventions import (CONVENTIONS, Convention, Outcome, Subject, adapter_subject,
                                               register_convention, verl_algorithm_config)
from otb_spec.conformance._report import REPORT_SCHEMA, REPORT_SCHEMA_VERSION, Report
from otb_spec.tolerances import machine_epsilon

__all__ = [
    "DEFAULT_TIMEOUT",
    "DEVIATIONS",
    "GENERATED_PROFILES",
    "KINDS",
    "LAYERS",
    "STATUSES",
    "CONVENTIONS",
    "Case",
    "CheckResult",
    "Comparison",
    "Convention",
    "Deviation",
    "Outcome",
    "Report",
    "REPORT_SCHEMA",
    "REPORT_SCHEMA_VERSION",
    "SHRINK_BUDGET",
    "Subject",
    "TargetError",
    "TargetTimeout",
    "adapter_subject",
    "assert_matches_reference",
    "compare",
    "compute_dtype_for",
    "find_case",
    "generated_cases",
    "golden_cases",
    "load_target",
    "read_skip_file",
    "register_convention",
    "robustness_cases",
    "special_cases",
    "verify",
    "verify_adapter",
    "verl_algorithm_config",
]


class TargetError(ValueError):
    """The target cannot be loaded or used (a usage error: exit status 2 on the command line)."""


def _on_path(folder: str) -> None:
    """Make ``folder``'s modules importable, as Python does for the script it runs (kept: a target may import at
    call time)."""
    if folder not in sys.path and os.path.abspath(folder) not in map(os.path.abspath, sys.path):
        sys.path.insert(0, folder)


def _package_of(path: str) -> tuple[str, str | None]:
    """(the folder above the outermost package holding the file ``path``, the file's dotted module name), or
    (its folder, None) for a file outside any package (no ``__init__.py`` beside it)."""
    folder, name = os.path.split(path)
    parts = [os.path.splitext(name)[0]]
    if not os.path.isfile(os.path.join(folder, "__init__.py")):
        return folder, None
    while os.path.isfile(os.path.join(folder, "__init__.py")):
        folder, package = os.path.split(folder)
        parts.insert(0, package)
    if parts[-1] == "__init__":
        parts.pop()
    return folder, ".".join(parts)


def load_target(spec: str) -> Callable:
    """Load ``"package.module:callable"`` or ``"path/to/file.py:callable"`` (``callable`` may be dotted,
    e.g. ``Class.method``). Raises :class:`TargetError` saying what is wrong."""
    module_name, colon, attribute = spec.rpartition(":") if spec.count(":") > 1 else spec.partition(":")
    if not colon or not module_name or not attribute:
        raise TargetError(f"TARGET: expected 'package.module:callable' or 'path/to/file.py:callable', got {spec!r}")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise TargetError(f"TARGET: no file {module_name!r}")
        path = os.path.abspath(module_name)
        package_root, dotted = _package_of(path)
        _on_path(os.getcwd())                    # as `python -m`: the current folder's packages import (trainer.x)
        _on_path(os.path.dirname(path))          # as `python file.py` runs it: its folder's modules import
        if dotted is not None:          # a module of a package: imported by its dotted name (relative imports work)
            _on_path(package_root)
            try:
                module = importlib.import_module(dotted)
            except Exception as exc:
                raise TargetError(f"TARGET: importing {module_name} (as {dotted}) failed: {type(exc).__name__}: "
                                  f"{exc}") from exc
        else:
            unique = f"otb_spec_target_{abs(hash(path))}"
            location = importlib.util.spec_from_file_location(unique, module_name)
            module = importlib.util.module_from_spec(location)
            sys.modules[unique] = module
            try:
                location.loader.exec_module(module)
            except Exception as exc:
                del sys.modules[unique]
                raise TargetError(f"TARGET: importing {module_name} failed: {type(exc).__name__}: {exc}") from exc
    else:
        _on_path(os.getcwd())           # as `python -m`: modules of the current folder import
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            raise TargetError(f"TARGET: cannot import {module_name!r}: {type(exc).__name__}: {exc}") from exc
    value: Any = module
    for part in attribute.split("."):
        if not hasattr(value, part):
            raise TargetError(f"TARGET: {module_name!r} has no attribute {attribute!r}")
        value = getattr(value, part)
    if not callable(value):
        raise TargetError(f"TARGET: {spec!r} is a {type(value).__name__}, not a callable")
    return value


def _subject(target: Callable | str, kind: str, convention: str, device: str,
             working_dtype: str | None = None) -> tuple[Subject, str]:
    if kind not in KINDS:
        raise TargetError(f"kind: expected one of {', '.join(KINDS)}, got {kind!r}")
    if convention not in CONVENTIONS:
        raise TargetError(f"convention: expected one of {', '.join(CONVENTIONS)}, got {convention!r}")
    chosen = CONVENTIONS[convention]
    if kind not in chosen.kinds:
        raise TargetError(f"kind: the {convention} convention has no {kind!r} (it has {', '.join(chosen.kinds)})")
    try:
        _check_working_dtype(working_dtype, kind)
    except ValueError as exc:
        raise TargetError(str(exc)) from exc
    if isinstance(target, str):
        spec, function = target, load_target(target)
    elif callable(target):
        spec = f"{getattr(target, '__module__', '?')}:{getattr(target, '__qualname__', repr(target))}"
        function = target
    else:
        raise TargetError(f"target: expected a callable or 'module:callable', got {type(target).__name__}")
    built_from = spec
    if inspect.isclass(function):         # e.g. verl's FusedLinearForPPO, a torch.nn.Module: call an instance
        try:
            function = function()
        except Exception as exc:
            raise TargetError(f"TARGET: {spec} is a class; instantiating it with no arguments failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        built_from = f"{spec}()"
    try:
        subject = chosen.build(function, built_from, kind, device)
    except (ImportError, RuntimeError) as exc:
        raise TargetError(f"convention {convention!r}: {exc}") from exc
    if kind in _WORKING_KINDS:
        subject = _with_working_bound(subject, kind, working_dtype)
    elif working_dtype is not None:                   # OTB kinds: None is verl's, each input dtype its own
        subject = _with_working_precision(subject, working_dtype)
    return subject, spec


_WORKING_KINDS = (FUSED, "sum-pi-squared")      # kinds whose bound can assume a working precision above the inputs'


def _check_working_dtype(working_dtype: str | None, kind: str) -> None:
    """ValueError unless ``working_dtype`` is None or a precision ``kind`` is held to a bound in."""
    if working_dtype is not None and working_dtype not in ("float64", "float32", "float16", "bfloat16"):
        raise ValueError(f"working_dtype: expected float64, float32, float16 or bfloat16, got {working_dtype!r}")
    if working_dtype is not None and kind not in _WORKING_KINDS and working_dtype not in ("float64", "float32"):
        raise ValueError(f"working_dtype: float32 or float64 for the OTB kinds (a port computing its sums in "
                         f"{working_dtype} is not held to a bound: docs/tolerances.md), got {working_dtype!r}")


def _with_working_bound(subject: Subject, kind: str, working_dtype: str | None) -> Subject:
    """The subject with its working precision and a report line saying which bound judges it."""
    if working_dtype is None:
        rule = ("working precision = the inputs' dtype (the logits and per-token values may be rounded to it: "
                "bfloat16 inputs are judged with bfloat16's ε, as verl forms its logits in the inputs' dtype)"
                if kind == FUSED else
                "working precision = the logits' dtype (log-sum-exps and exponentials may be rounded to it, as verl's "
                "calculate_sum_pi_squared_from_logits does for bfloat16 logits)")
        working = subject.working_dtype
    else:
        widens = "before the matmul" if kind == FUSED else "before anything else"
        rule = (f"working precision = the inputs' dtype or {working_dtype}, whichever is more precise "
                f"(working_dtype={working_dtype!r}: a target that widens its inputs {widens})")
        working = _at_least(working_dtype)

    functions = ("otb_spec.tolerances.hidden_statistics_tolerance and hidden_gradient_tolerance" if kind == FUSED else
                 "otb_spec.tolerances.sum_pi_squared_tolerance")
    bound = (f"bound:       {functions} (+ the reference's float64 bound + each output's rounding), {rule}; sums "
             "accumulated in float32 (float64 for float64 inputs)")
    return replace(subject, working_dtype=working, notes=subject.notes + (bound,))


def _with_working_precision(subject: Subject, working_dtype: str) -> Subject:
    """An OTB subject that computes in ``working_dtype`` whatever its inputs (a port that calls ``.float()`` or
    ``.double()`` first): inputs more precise than that are judged as if rounded to it, summed in it and returned in
    it; less precise ones (exact in it) as widened to it — held to its bound, not to the inputs' dtype's, which must
    admit verl's half-precision arithmetic (docs/conformance.md)."""
    def working(dtype: str) -> str:
        return working_dtype

    bound = (f"bound:       otb_spec.tolerances.otb_comparison_tolerance, working_dtype={working_dtype!r}: a target "
             f"that computes in {working_dtype} whatever its inputs — inputs more precise than that judged as "
             f"rounded to {working_dtype}, summed in it and returned in it; less precise ones as widened to it")
    return replace(subject, working_dtype=working, compute_dtype=working, notes=subject.notes + (bound,))


def _with_least_working_precision(subject: Subject, working_dtype: str) -> Subject:
    """An OTB subject whose per-token arithmetic is done in at least ``working_dtype`` (an adapter's promise): less
    precise inputs are judged as widened to it and held to its bound; more precise ones keep their own; the sums stay
    in the subject's compute dtype."""
    bound = (f"bound:       otb_spec.tolerances.otb_comparison_tolerance, working_dtype={working_dtype!r}: per-token "
             f"arithmetic in at least {working_dtype} — half-precision inputs judged as widened to it and held to its "
             f"bound, more precise ones in their own precision; sums in the adapter's compute_dtype")
    return replace(subject, working_dtype=_at_least(working_dtype), notes=subject.notes + (bound,))


def _at_least(working_dtype: str) -> Callable[[str], str]:
    """input dtype → the more precise of it and ``working_dtype`` (a target that widens its inputs first)."""
    limit = machine_epsilon(working_dtype)

    def working(dtype: str) -> str:
        return dtype if machine_epsilon(dtype) <= limit else working_dtype

    return working


def verify(target: Callable | str, kind: str, *, convention: str = "verl", device: str = "cpu",
           max_examples: int = 100, seed: int = 0, layers: Iterable[str] = LAYERS,
           skips: Iterable[tuple[str, str]] = (), shrink_budget: int = SHRINK_BUDGET, strict: bool = False,
           timeout: float | None = DEFAULT_TIMEOUT, progress: Callable[[str], None] | None = None,
           fail_fast: bool = False, working_dtype: str | None = None) -> Report:
    """Check an implementation of ``kind`` against the reference; returns a :class:`Report`.

    Args:
      target: the callable, or ``"package.module:callable"`` / ``"path/to/file.py:callable"``; a class (e.g. a
        ``torch.nn.Module`` such as verl's ``FusedLinearForPPO``) is instantiated once with no arguments and the
        instance is called.
      kind: ``"otb"``, ``"tir-otb"``, ``"loo-otb"``, ``"tir-loo-otb"``, ``"sum-pi-squared"`` or
        ``"fused-token-statistics"``.
      convention: how the callable is called (``CONVENTIONS``; default ``"verl"``).
      device: where inputs are placed (``"cpu"``, ``"cuda"``; for the jax convention a JAX platform).
      max_examples: Hypothesis examples per profile of the generated layer (:data:`GENERATED_PROFILES`).
      seed: Hypothesis seed (the same seed replays the same cases).
      layers: which of :data:`LAYERS` to run.
      skips: ``(check-id pattern, reason)`` pairs (:func:`read_skip_file`).
      shrink_budget: further runs Hypothesis may spend shrinking a failing generated case (0: no shrinking).
      strict: count the documented deviations of verl 0.9.1 (``DEVIATIONS``) as failures.
      timeout: seconds one call of the target may take (None or 0: no limit); a call that does not return fails its
        check, and the remaining checks are not run.
      progress: called with a short label before each check (the command line shows it on a terminal).
      fail_fast: stop at the first failing check.
      working_dtype: fused-token-statistics and sum-pi-squared — hold the target to the bound of a program
        working in at least this precision (e.g. ``"float32"`` for a kernel that widens bfloat16 inputs before its
        matmul, or a Σπ² that widens bfloat16 logits before its log-sum-exps); default: the inputs' dtype (verl's
        ``FusedLinearForPPO`` forms its logits in the inputs' dtype; its Σπ² rounds its log-sum-exps to the logits'
        dtype). The OTB kinds: ``"float32"`` or ``"float64"`` — the target computes in that dtype whatever its inputs
        (``.float()``, ``.double()``): more precise inputs are judged as rounded to it, summed in it, and may come
        back in it; less precise ones (bfloat16, float16) as widened to it, held to its bound; None — as verl, each
        input dtype in its own precision (sums of half-precision inputs in float32). The report says which.
    Raises:
      TargetError: the target cannot be loaded, or the convention does not offer ``kind`` or ``device``.
    """
    start = time.perf_counter()
    subject, spec = _subject(target, kind, convention, device, working_dtype)
    results = run_checks(subject, kind, max_examples=max_examples, seed=seed, layers=layers, skips=skips,
                         shrink_budget=shrink_budget, strict=strict, timeout=timeout, progress=progress,
                         fail_fast=fail_fast)
    return Report(spec, convention, subject.name, (kind,), device, seed, max_examples, results,
                  time.perf_counter() - start, strict, notes=subject.notes)


def verify_adapter(adapter: Any, *, kinds: Iterable[str] | None = None, max_examples: int = 100, seed: int = 0,
                   layers: Iterable[str] = LAYERS, skips: Iterable[tuple[str, str]] = (),
                   shrink_budget: int = SHRINK_BUDGET, strict: bool = False, timeout: float | None = DEFAULT_TIMEOUT,
                   progress: Callable[[str], None] | None = None, fail_fast: bool = False,
                   working_dtype: str | None = None, **options: Any) -> Report:
    """Check a port through the adapter protocol: every kind it implements (or ``kinds``).

    ``adapter`` is an adapter object or a registered name (``"torch-cpu"``, ``"jax-cpu"``, an entry-point name);
    ``options`` go to its factory. ``working_dtype`` (``"float32"`` or ``"float64"``): the port does its per-token
    arithmetic and running totals in at least this precision — half-precision inputs are then held to that dtype's
    bound instead of the one verl's half-precision arithmetic needs (a port that keeps W as a bfloat16 running total
    while ``compute_dtype`` says float32 fails); more precise inputs keep their own (sums in
    ``adapter.compute_dtype``). None: each input dtype in its own precision, as :func:`verify`."""
    from otb_spec.adapters import load_adapter

    start = time.perf_counter()
    if isinstance(adapter, str):
        try:
            adapter = load_adapter(adapter, **options)
        except (ValueError, TypeError, ImportError) as exc:
            raise TargetError(f"--adapter: {exc}") from exc
        except Exception as exc:                # the adapter's own module is broken (a SyntaxError, …)
            raise TargetError(f"--adapter: loading {adapter!r} failed: {type(exc).__name__}: {exc}") from exc
    if working_dtype is not None and working_dtype not in ("float64", "float32"):
        raise TargetError(f"working_dtype: float32 or float64 for an adapter (the precision its per-token arithmetic "
                          f"is at least done in), got {working_dtype!r}")
    subject = adapter_subject(adapter)
    chosen = tuple(kinds) if kinds is not None else subject.kinds
    unknown = [kind for kind in chosen if kind not in KINDS]
    if unknown:
        raise TargetError(f"kind: expected some of {', '.join(KINDS)}, got {', '.join(unknown)}")
    missing = [kind for kind in chosen if kind not in subject.kinds]
    if missing:
        raise TargetError(f"kind: the adapter protocol checks {', '.join(subject.kinds)}, not {', '.join(missing)}")
    results: list[CheckResult] = []
    notes: tuple[str, ...] = ()
    for kind in chosen:
        judged = subject
        if working_dtype is not None:
            judged = (_with_working_bound(subject, kind, working_dtype) if kind in _WORKING_KINDS
                      else _with_least_working_precision(subject, working_dtype))
            notes += tuple(note for note in judged.notes if note not in notes + subject.notes)
        results += run_checks(judged, kind, max_examples=max_examples, seed=seed, layers=layers, skips=skips,
                              shrink_budget=shrink_budget, strict=strict, timeout=timeout, progress=progress,
                              fail_fast=fail_fast)
    return Report(f"adapter {getattr(adapter, 'name', type(adapter).__name__)}", "adapter", subject.name, chosen,
                  subject.device, seed, max_examples, results, time.perf_counter() - start, strict,
                  notes=subject.notes + notes)


def find_case(kind: str, name: str, dtype: str) -> Case:
    """The golden, special or robustness case of ``kind`` called ``name``, delivered in ``dtype`` (used by report
    snippets)."""
    for case in (golden_cases(kind, (dtype,)) + special_cases(kind) + special_cases(kind, equal_groups=True)
                 + robustness_cases(kind)):
        if case.name == name and case.dtype == dtype:
            return case
    raise ValueError(f"name: no golden or special {kind!r} case {name!r} in {dtype}")


def assert_matches_reference(case: Case, *, output_dtypes: dict[str, str] | None = None,
                             compute_dtype: str | None = None, working_dtype: str | None = None,
                             **outputs: Any) -> None:
    """Raise :class:`AssertionError` unless ``outputs`` (``advantages=…, returns=…``, ``sum_pi_squared=…`` or, for
    fused token statistics, ``log_probs=…, entropy=…`` and optionally ``sum_pi_squared``, ``grad_hidden``,
    ``grad_weight``; any array-likes, torch tensors included) match the reference on ``case`` — the rule ``verify``
    uses. Each output is judged with the rounding of the dtype it comes in (``output_dtypes``: name → dtype name, for
    array-likes that do not carry the one the implementation returned); one less precise than the case's inputs (a
    float32 case returned as bfloat16) fails, as ``verify``'s structure check fails it. ``compute_dtype`` and
    ``working_dtype`` are :func:`otb_spec.conformance.compare`'s (``working_dtype="float32"``: judged as a program that
    computes in float32 whatever its inputs, as ``verify(..., working_dtype="float32")`` — for the OTB kinds its sums
    too (``compute_dtype`` defaults to it), and a float64 case may come back in float32, as from JAX without x64; for
    the fused and Σπ² kinds, as in ``verify``, the precision the kernel works in at least — the case's own where that
    is higher — and outputs stay held to the inputs' dtype; ``ValueError`` for a precision ``verify`` refuses). An
    output name the case has not raises :class:`TypeError`."""
    unknown = sorted(set(outputs) - set(case.output_names))
    if unknown:
        raise TypeError(f"assert_matches_reference: unexpected output(s) {', '.join(map(repr, unknown))}; "
                        f"a {case.kind} case's outputs are {', '.join(case.output_names)}")
    hosted = {name: _to_numpy(value) for name, value in outputs.items()}
    dtypes = dict(output_dtypes or {})
    for name, value in outputs.items():
        dtypes.setdefault(name, str(getattr(value, "dtype", "")).replace("torch.", "") or case.dtype)
    # as verify (_subject): an OTB kind computing in ``working_dtype`` whatever its inputs sums in it too and may return
    # in it; for the fused and Σπ² kinds ``working_dtype`` is a floor (a kernel that widens its inputs), never below
    # the case's own precision
    _check_working_dtype(working_dtype, case.kind)
    narrows = working_dtype is not None and _less_precise(working_dtype, case.dtype)
    if case.kind in _WORKING_KINDS:
        if narrows:
            working_dtype, narrows = case.dtype, False
    elif working_dtype is not None and compute_dtype is None:
        compute_dtype = working_dtype
    promised = working_dtype if narrows else case.dtype
    problems = [f"{name}: returned in {dtype}, less precise than "
                + (f"the case's {case.dtype} inputs" if promised == case.dtype else
                   f"working_dtype={working_dtype!r} (the case's inputs are {case.dtype})")
                for name, dtype in dtypes.items() if name in outputs and _less_precise(dtype, promised)]
    problems += [c.describe() for c in compare(case, hosted, output_dtypes=dtypes, compute_dtype=compute_dtype,
                                               working_dtype=working_dtype) if not c.ok]
    if problems:
        raise AssertionError(f"{case.describe()}:\n  " + "\n  ".join(problems))


def _less_precise(dtype: str, than: str) -> bool:
    """Whether floating ``dtype`` has a larger machine epsilon than ``than`` (False for integer or unknown dtypes)."""
    from otb_spec.tolerances import machine_epsilon

    try:
        return machine_epsilon(dtype) > machine_epsilon(than)
    except ValueError:
        return False


def _to_numpy(value: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        value = value.detach().cpu()
        return (value.float() if value.dtype in (torch.bfloat16, torch.float16) else value).numpy()
    import numpy as np

    return np.asarray(value).astype(np.float64)
