"""The layered checks, in the order a standards conformance suite runs them.

1. **signature** — the target can be called the way its convention says (a warning where it is checked through
   another call than the convention's trainer makes: under ``verl``, positionally, its parameter names not verl's);
2. **structure** — on one ordinary case in every dtype the convention delivers: it runs, outputs have the input's
   shape, the convention's dtype rule holds, outputs stay on the inputs' device, inputs are not modified, and a second
   call gives the same outputs;
3. **golden** — hand-built cases, each isolating one behaviour real implementations get wrong;
4. **generated** — Hypothesis-generated cases (seeded; a failure is shrunk to a minimal case);
5. **special** — long sequences and large or extreme inputs, where low-precision accumulation shows;
6. **robustness** — values no trainer produces at masked positions; a difference there is a warning, never a failure.

Every value check compares each output with the reference elementwise, within the per-element tolerance of
:meth:`Case.tolerances` (``otb_spec.tolerances`` — one documented place); an output that is NaN or ±inf where the
reference is finite is always a failure. A value check that fails against the reference but matches a documented
deviation of verl 0.9.1 (``_deviations``) gets the status ``"deviation"``: listed, not failed, unless ``strict``.

Statuses: ``pass``, ``fail``, ``deviation`` (a documented difference from verl), ``warn`` (worth knowing, never a
failure: robustness to impossible inputs, bit-level nondeterminism, a more precise output dtype than verl's, a target
verl's trainer could not call by keyword), ``skip``.

Every call of the target runs under a per-call time limit (``timeout``): a target that does not return is reported as
failing that check, and the remaining checks are not run (the verdict is then NOT CONFORMANT, not a stuck terminal).
"""

from __future__ import annotations

import contextlib
import fnmatch
import math
import re
import tempfile
import threading
import time
import traceback
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

import numpy as np

from otb_spec.conformance._cases import (_OTB_KINDS, GENERATED_PROFILES, Case, generated_cases, golden_cases,
                                         robustness_cases, special_cases)
from otb_spec.conformance._conventions import Outcome, Subject
from otb_spec.conformance._deviations import RAISES, Deviation, deviations_for
from otb_spec.tolerances import machine_epsilon

__all__ = ["LAYERS", "STATUSES", "SHRINK_BUDGET", "DEFAULT_TIMEOUT", "TARGET_THREAD", "Comparison", "CheckResult",
           "compare", "run_checks", "read_skip_file"]

LAYERS = ("signature", "structure", "golden", "generated", "special", "robustness")
STATUSES = ("pass", "fail", "deviation", "warn", "skip")
_STRUCTURE_DTYPES = ("float64", "float32", "bfloat16")
_VALUE_DTYPES = ("float64", "float32")
DEFAULT_TIMEOUT = 120.0      # seconds per call of the target (the T = 4096 special cases included)


@dataclass
class Comparison:
    """One output compared with the reference.

    ``max_abs_error`` and ``max_rel_error`` are over the elements with a finite tolerance (``checked_fraction`` of
    them; the rest are ill-conditioned); ``worst_*`` describe the element furthest outside its tolerance — the largest
    ratio of error to allowed error, ``worst_ratio`` (or the closest to it, when all pass) — and ``worst_allowed`` its
    tolerance ``atol + rtol·|expected|``. ``first_nan`` is the first position (row-major) where the output is NaN and
    the reference is not, and ``first_nan_masked`` whether the mask is 0 there; ``worst_masked`` whether the mask is
    0 at the worst element.
    """

    output: str
    violations: int
    size: int
    max_abs_error: float
    max_rel_error: float
    checked_fraction: float
    worst_index: tuple[int, ...] | None
    worst_got: float | None
    worst_expected: float | None
    worst_allowed: float | None
    tolerance_reason: str
    shape_problem: str = ""
    worst_ratio: float = 0.0
    first_nan: tuple[int, ...] | None = None
    first_nan_masked: bool = False
    worst_masked: bool = False

    @property
    def ok(self) -> bool:
        return not self.shape_problem and self.violations == 0

    def describe(self) -> str:
        if self.shape_problem:
            return f"{self.output}: {self.shape_problem}"
        where = ""
        if self.worst_index is not None:
            got, expected = _distinguishing(self.worst_got, self.worst_expected)
            error = abs(self.worst_got - self.worst_expected) if _finite(self.worst_got) else math.nan
            exact = self.worst_allowed is not None and self.worst_allowed < _EXACT
            excess = "the reference is exact here" if exact else f"{_ratio(self.worst_ratio)} the allowed error"
            masked = (", a MASKED position (mask 0 there: the reference's returns still carry the rewards to come, "
                      "Σ_{k≥t} mₖrₖ, and its advantages are 0)") if self.worst_masked and self.violations else ""
            where = (f"; worst at {self.worst_index}{masked}: got {got}, expected {expected} (|Δ| = {_number(error)}, "
                     f"allowed {_number(self.worst_allowed)}" + (f", {excess}" if self.violations else "") + ")")
        head = (f"{self.output}: {self.violations} of {self.size} elements outside tolerance" if self.violations
                else f"{self.output}: all {self.size} elements within tolerance")
        nan = ""
        if self.first_nan is not None:
            nan = (f"; NaN first appears at {self.first_nan}, a MASKED position (mask 0 there: look for 0/0 or inf·0 on "
                   "padding or tool output)" if self.first_nan_masked else f"; NaN first appears at {self.first_nan}")
        return (f"{head}{where}{nan}; max abs error {_number(self.max_abs_error)}, max rel error "
                f"{_number(self.max_rel_error)} over {self.checked_fraction:.0%} checked elements; tolerance: "
                f"{self.tolerance_reason}")


@dataclass
class CheckResult:
    """The result of one check. ``status``: one of :data:`STATUSES`.

    ``deviation`` names the documented deviation a ``"deviation"`` check matched (or, with ``strict``, the one a
    failing check matched); ``ratio`` is how far outside its tolerance the check's worst element was (error / allowed;
    inf for an exception, a timeout, NaN or a shape error), which decides which failure the report shows in full — for
    a passing value check its margin, the largest error / allowed (below 1);
    ``call`` describes the arguments the target was called with and ``traceback`` its exception, if it raised.
    """

    id: str
    layer: str
    kind: str
    status: str
    message: str = ""
    case: str = ""
    note: str = ""
    comparisons: list[Comparison] = field(default_factory=list)
    snippet: str = ""
    examples: int | None = None
    seconds: float = 0.0
    deviation: str = ""
    ratio: float = 0.0
    call: str = ""
    traceback: str = ""

    def to_dict(self) -> dict:
        data = asdict(self)
        data["comparisons"] = [dict(asdict(c), ok=c.ok) for c in self.comparisons]
        return _json_safe(data)


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(value)


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.6g}"


_EXACT = 1e-290      # an allowed error below this is the underflow allowance of an exact result: no ratio shown


def _ratio(value: float) -> str:
    return "∞×" if not math.isfinite(value) else f"{value:.3g}×"


def _distinguishing(got: float | None, expected: float | None) -> tuple[str, str]:
    """got and expected with as many significant digits as it takes to tell them apart (6 at least, 17 at most):
    never "got 0.5, expected 0.5"."""
    if got is None or expected is None:
        return _number(got), _number(expected)
    for digits in range(6, 18):
        a, b = f"{got:.{digits}g}", f"{expected:.{digits}g}"
        if a != b or got == expected:
            return a, b
    return repr(float(got)), repr(float(expected))


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(item) for item in value]
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return value if math.isfinite(value) else repr(value)   # JSON has no NaN/inf: "nan", "inf", "-inf"
    if isinstance(value, np.integer):
        return int(value)
    return value


# ----------------------------------------------------------------------------------------------------------------------
# comparing values


def compare(case: Case, outputs: dict[str, Any], *, output_dtypes: dict[str, str] | None = None,
            compute_dtype: str | None = None, expected: dict[str, np.ndarray] | None = None,
            working_dtype: str | None = None) -> list[Comparison]:
    """Compare an implementation's outputs on ``case`` with the reference, output by output.

    Args:
      case: the conformance case.
      outputs: ``{"advantages": …, "returns": …}`` (OTB kinds), ``{"sum_pi_squared": …}`` or, for fused token
        statistics, ``{"log_probs": …, "entropy": …}`` with optionally ``sum_pi_squared``, ``grad_hidden`` and
        ``grad_weight`` (:attr:`Case.optional_outputs` are compared only where given); any array-likes.
      output_dtypes: the dtype name of each output as the implementation returned it (its rounding is allowed for);
        default the case's dtype.
      compute_dtype: the precision the implementation accumulates in; default float64 for float64 inputs, float32
        otherwise.
      expected: compare with these outputs instead of the reference's (a documented deviation's model); NaN there
        is matched only by NaN.
      working_dtype: the implementation's working precision (``Case.tolerances``: for the fused kind its logits and
        per-token values, for Σπ² its log-sum-exps, for the OTB kinds the inputs as it rounds them; default the
        case's dtype).
    """
    expected = case.expected() if expected is None else expected
    mask = np.asarray(case.response_mask) if case.response_mask is not None else None
    comparisons = []
    for name in case.output_names:
        if name in case.optional_outputs and name not in outputs:
            continue
        dtype = (output_dtypes or {}).get(name) or case.dtype
        try:
            machine_epsilon(dtype)
        except ValueError:
            dtype = case.dtype                                   # an integer or unknown dtype: judged by the values
        tolerance = case.tolerances(output_dtype=dtype, compute_dtype=compute_dtype,
                                    working_dtype=working_dtype)[name]
        want = np.asarray(expected[name], dtype=np.float64)
        if name not in outputs:
            comparisons.append(Comparison(name, want.size, want.size, math.inf, math.inf, 0.0, None, None, None,
                                          None, tolerance.reason, shape_problem="missing from the outputs",
                                          worst_ratio=math.inf))
            continue
        try:
            got = np.asarray(outputs[name], dtype=np.float64)
        except (TypeError, ValueError) as exc:
            comparisons.append(Comparison(name, want.size, want.size, math.inf, math.inf, 0.0, None, None, None,
                                          None, tolerance.reason, shape_problem=f"not a numeric array ({exc})",
                                          worst_ratio=math.inf))
            continue
        if got.shape != want.shape:
            comparisons.append(Comparison(name, want.size, want.size, math.inf, math.inf, 0.0, None, None, None,
                                          None, tolerance.reason,
                                          shape_problem=f"shape {got.shape}, expected {want.shape}",
                                          worst_ratio=math.inf))
            continue
        comparisons.append(_compare_values(name, got, want, tolerance, mask if mask is not None and
                                           mask.shape == want.shape else None))
    return comparisons


def _compare_values(name: str, got: np.ndarray, want: np.ndarray, tolerance, mask: np.ndarray | None) -> Comparison:
    allowed = np.broadcast_to(np.asarray(tolerance.atol, dtype=np.float64)
                              + np.asarray(tolerance.rtol, dtype=np.float64) * np.abs(np.nan_to_num(want)), want.shape)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        both_nan = np.isnan(got) & np.isnan(want)                       # a model's NaN, matched
        error = np.where(both_nan, 0.0, np.nan_to_num(np.abs(got - want), nan=np.inf))   # NaN output: infinitely wrong
        checked = np.isfinite(allowed) & ~np.isnan(want)
        not_finite = (~np.isfinite(got) & np.isfinite(want)) | (np.isnan(want) & ~np.isnan(got))
        considered = checked | not_finite
        bad = not_finite | (checked & (error > allowed))
        excess = np.where(allowed > 0, error / np.where(allowed > 0, allowed, 1.0), np.where(error > 0, np.inf, 0.0))
        excess = np.where(not_finite, np.inf, np.where(checked, excess, -np.inf))
        relative = np.where(want != 0, error / np.abs(np.where(want != 0, want, 1.0)), np.where(error > 0, np.inf, 0.0))
    worst = None
    if want.size and considered.any():
        worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(excess)), want.shape))
    pick = (lambda a: float(a[worst])) if worst is not None else (lambda a: None)
    surprise_nan = np.isnan(got) & ~np.isnan(want)
    first_nan, first_nan_masked = None, False
    if surprise_nan.any():
        first_nan = tuple(int(i) for i in np.argwhere(surprise_nan)[0])
        first_nan_masked = mask is not None and bool(mask[first_nan] == 0)
    return Comparison(
        name, int(bad.sum()), int(want.size), float(np.max(np.where(considered, error, 0.0), initial=0.0)),
        float(np.max(np.where(considered, relative, 0.0), initial=0.0)), float(checked.mean()) if want.size else 1.0,
        worst, pick(got), pick(want), pick(allowed), tolerance.reason,
        worst_ratio=max(float(excess[worst]), 0.0) if worst is not None else 0.0,
        first_nan=first_nan, first_nan_masked=first_nan_masked,
        worst_masked=worst is not None and mask is not None and bool(mask[worst] == 0))


# ----------------------------------------------------------------------------------------------------------------------
# skip files


def read_skip_file(path: str) -> list[tuple[str, str]]:
    """Read a skip file: one check-id pattern per line (shell wildcards, e.g. ``otb/special/*``), then optionally
    ``# why``. Blank lines and lines starting with ``#`` are ignored. Returns ``[(pattern, reason), …]``; a pattern
    without a reason is an error (every skip must say why)."""
    entries = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            text = line.strip()
            if not text or text.startswith("#"):
                continue
            pattern, _, reason = text.partition("#")
            if not reason.strip():
                raise ValueError(f"skip file {path}, line {number}: {pattern.strip()!r} needs a reason after '#'")
            entries.append((pattern.strip(), reason.strip()))
    return entries


def _skip_reason(check_id: str, skips: Iterable[tuple[str, str]]) -> str | None:
    for pattern, reason in skips:
        if fnmatch.fnmatchcase(check_id, pattern):
            return reason
    return None


# ----------------------------------------------------------------------------------------------------------------------
# calling the target: time limit, exceptions


class TargetTimeout(Exception):
    """The target did not return within the time limit."""


TARGET_THREAD = "otb-spec-verify-target"     # the name of the thread each call of the target runs in


class _Session:
    """What the checks of one run share: the subject, the time limit, and whether the target has hung."""

    def __init__(self, subject: Subject, timeout: float | None, strict: bool,
                 progress: Callable[[str], None] | None):
        self.subject = subject
        self.timeout = timeout
        self.strict = strict
        self.progress = progress
        self.hung = ""

    def run(self, case: Case) -> Outcome:
        """``subject.run(case)`` in a worker thread, waited for at most ``timeout`` seconds. A call that does not return
        raises :class:`TargetTimeout`; the thread is abandoned (a daemon: it cannot keep the process alive) and every
        later call is refused, since the target may be stuck for good. Warnings the target emits are recorded, not
        raised: a caller's filter that turns them into errors (pytest's ``-W error``) must not change the verdict."""
        if self.hung:
            raise TargetTimeout(self.hung)
        if not self.timeout:
            return self._run_quietly(case)
        box: dict[str, Any] = {}

        def work() -> None:
            try:
                box["outcome"] = self._run_quietly(case)
            except BaseException as exc:        # noqa: BLE001 - handed to the caller below
                box["error"] = exc

        worker = threading.Thread(target=work, name=TARGET_THREAD, daemon=True)
        worker.start()
        worker.join(self.timeout)
        if worker.is_alive():
            self.hung = (f"the target did not return within {self.timeout:g} s (--timeout) on {case.describe()}; the "
                         f"remaining checks were not run")
            raise TargetTimeout(self.hung)
        if "error" in box:
            raise box["error"]
        return box["outcome"]

    def _run_quietly(self, case: Case) -> Outcome:
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("always")
            return self.subject.run(case)

    def tell(self, text: str) -> None:
        if self.progress is not None:
            self.progress(text)


def _target_traceback(exc: BaseException) -> str:
    """The exception's traceback from the first frame outside otb_spec.conformance (the target's own frames)."""
    frames = traceback.extract_tb(exc.__traceback__)
    outside = [i for i, frame in enumerate(frames) if "otb_spec/conformance" not in frame.filename.replace("\\", "/")]
    shown = frames[outside[0]:] if outside else frames
    lines = ["Traceback (most recent call last):\n"] + traceback.format_list(shown)
    lines += traceback.format_exception_only(type(exc), exc)
    return "".join(lines).rstrip()


# ----------------------------------------------------------------------------------------------------------------------
# the layers


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("ε", "epsilon").replace("ρ", "rho").replace("σ", "sigma")
                  .replace("π", "pi").replace("τ", "tau").replace("±", "pm").replace("²", "2")
                  .replace("→", "to")).strip("-")


def _matching_deviation(session: _Session, case: Case, outcome: Outcome | None,
                        deviations: tuple[Deviation, ...]) -> tuple[Deviation, list[Comparison]] | None:
    """The documented deviation whose model the outcome (or the exception, ``outcome=None``) matches, if any."""
    for deviation in deviations:
        if not deviation.applies(case) or (deviation.mask_dtypes is not None and
                                           session.subject.mask_dtype(case) not in deviation.mask_dtypes):
            continue
        model = deviation.model(case)
        if outcome is None:
            if model == RAISES:
                return deviation, []
            continue
        if model == RAISES:
            continue
        if deviation.fingerprint is not None and not deviation.fingerprint(case, outcome.output_dtypes):
            continue
        judged = deviation.judged_as(case) if deviation.judged_as is not None else None
        expected = _nan_where_taken(model, case.expected(), outcome.outputs) if deviation.nan_optional else model
        comparisons = compare(case, outcome.outputs, output_dtypes=outcome.output_dtypes,
                              compute_dtype=judged or session.subject.compute_dtype(case.dtype), expected=expected,
                              working_dtype=judged or session.subject.working_dtype(case.dtype))
        if all(c.ok for c in comparisons):
            return deviation, comparisons
    return None


def _nan_where_taken(model: dict, reference: dict, outputs: dict) -> dict:
    """A model whose NaN are optional, made definite for these outputs: NaN where the model allows it and the output
    took it, the reference's value at the model's other NaN (the model's values elsewhere)."""
    definite = {}
    for name, allowed in model.items():
        allowed = np.asarray(allowed, dtype=np.float64)
        try:
            got = np.asarray(outputs.get(name), dtype=np.float64)
        except (TypeError, ValueError):
            got = None
        taken = np.isnan(allowed) & np.isnan(got) if got is not None and got.shape == allowed.shape else \
            np.isnan(allowed)
        definite[name] = np.where(taken, np.nan, np.where(np.isnan(allowed), reference[name], allowed))
    return definite


def _value_check(session: _Session, case: Case, check_id: str, layer: str, snippet: bool = True,
                 deviations: tuple[Deviation, ...] = (), differences_warn: bool = False) -> CheckResult:
    """Run ``case`` and compare with the reference. ``differences_warn`` (the robustness layer): a difference is a
    warning, not a failure; a call that writes into its inputs fails in every layer."""
    start = time.perf_counter()
    subject = session.subject
    result = CheckResult(check_id, layer, case.kind, "pass", case=case.describe(), note=case.note)
    reason = subject.expressible(case)
    if reason:
        result.status, result.message = "skip", f"not expressible in this convention: {reason}"
        return result
    outcome = None
    try:
        outcome = session.run(case)
    except TargetTimeout as exc:
        result.status, result.message, result.ratio = "fail", f"timed out: {exc}", math.inf
        result.call = subject.describe_call(case)
    except Exception as exc:  # the implementation's own error is a finding, whatever its type
        result.status, result.message, result.ratio = "fail", f"raised {type(exc).__name__}: {exc}", math.inf
        result.call, result.traceback = subject.describe_call(case), _target_traceback(exc)
    else:
        result.comparisons = compare(case, outcome.outputs, output_dtypes=outcome.output_dtypes,
                                     compute_dtype=subject.compute_dtype(case.dtype),
                                     working_dtype=subject.working_dtype(case.dtype))
        failed = [c for c in result.comparisons if not c.ok]
        result.ratio = max((c.worst_ratio for c in result.comparisons), default=0.0)   # a pass: its margin (< 1)
        if failed:
            result.status = "fail"
            result.ratio = max(c.worst_ratio for c in failed)
            result.message = "; ".join(f"{c.output} differs from the reference" if not c.shape_problem else
                                       f"{c.output}: {c.shape_problem}" for c in failed)
    if result.status == "fail" and not session.hung and deviations:
        found = _matching_deviation(session, case, outcome, deviations)
        if found is not None:
            deviation, _ = found
            result.deviation = deviation.id
            what = (f"{result.message.removeprefix('raised ')} — raises, as verl does" if outcome is None else
                    "differs from the reference exactly as verl does")
            if session.strict:
                result.message += f" — documented deviation {deviation.id} ({deviation.category}): {what}; failed " \
                                  f"because of --strict"
            else:
                result.status = "deviation"
                result.message = (f"documented deviation {deviation.id} ({deviation.category}): {what} — "
                                  f"{deviation.title}; the reference: {deviation.reference}")
    if outcome is not None and outcome.mutated:         # never excused: no deviation writes into its inputs
        result.status, result.ratio, result.deviation = "fail", math.inf, ""
        modified = f"the call modified its inputs ({', '.join(outcome.mutated)}): inputs must be left unchanged"
        result.message = modified if not result.message or result.message.startswith("documented deviation") else \
            f"{result.message}; {modified}"
    elif differences_warn and result.status == "fail" and not session.hung:
        result.status, result.ratio = "warn", 0.0
        result.message = (f"on inputs no trainer produces ({case.name}) the result differs from the reference "
                          f"({result.message}) — a robustness note, not a failure")
    if result.status == "fail" and snippet:
        result.snippet = subject.snippet(case)
    result.seconds = time.perf_counter() - start
    return result


def _probe_case(kind: str) -> Case:
    """The ordinary case the structural checks run on."""
    cases = golden_cases(kind, ("float64",))
    return cases[1]                                    # non-contiguous string-id groups / ordinary logits


def _precision_rank(dtype: str) -> float:
    try:
        return -machine_epsilon(dtype)
    except ValueError:
        return -math.inf


def _structure_checks(session: _Session, kind: str, deviations: tuple[Deviation, ...] = ()) -> list[CheckResult]:
    start = time.perf_counter()
    subject = session.subject
    base = _probe_case(kind)
    if subject.equal_groups and kind != "sum-pi-squared":
        base = next(case for case in golden_cases(kind, ("float64",)) if subject.expressible(case) is None)
    dtypes = [dtype for dtype in _STRUCTURE_DTYPES if subject.supports_dtype(dtype)]
    names = ("runs", "shapes", "dtypes", "devices", "inputs-unchanged", "deterministic")
    problems: dict[str, list[str]] = {name: [] for name in names}
    notes: dict[str, list[str]] = {name: [] for name in names}
    documented: dict[str, list[tuple[str, Deviation]]] = {name: [] for name in names}   # explained by a deviation
    snippets: dict[str, str] = {}
    details: dict[str, tuple[str, str]] = {}
    returned = 0                                      # dtypes whose two calls returned: the other checks' evidence
    for dtype in dtypes:
        case = base.with_dtype(dtype)
        session.tell(f"{kind} structure {dtype}")
        try:
            first = session.run(case)
            second = session.run(case)
            returned += 1
        except Exception as exc:
            problems["runs"].append(f"{dtype}: {'timed out' if isinstance(exc, TargetTimeout) else 'raised'} "
                                    f"{type(exc).__name__}: {exc}")
            snippets.setdefault("runs", subject.snippet(case))
            if not isinstance(exc, TargetTimeout):
                details.setdefault("runs", (subject.describe_call(case), _target_traceback(exc)))
            if session.hung:
                break
            continue
        names_here = [name for name in case.output_names
                      if name not in case.optional_outputs or name in first.outputs]
        complete = all(name in first.outputs and name in second.outputs for name in names_here)
        drift = {c.output: c for c in compare(case, second.outputs, output_dtypes=first.output_dtypes,
                                              compute_dtype=subject.compute_dtype(dtype), expected=first.outputs,
                                              working_dtype=subject.working_dtype(dtype))
                 } if complete else {}
        for name in names_here:
            value = first.outputs.get(name)
            if value is None:
                problems["shapes"].append(f"{dtype}: output {name} missing")
                continue
            shape = case.output_shape(name)
            if tuple(value.shape) != tuple(shape):
                problems["shapes"].append(f"{dtype}: {name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
            got_dtype = first.output_dtypes.get(name, "?")
            # a declared narrowing (an OTB target computing in float32 whatever its inputs) may return its precision
            promised = min((dtype, subject.working_dtype(dtype)), key=_precision_rank)
            if _precision_rank(got_dtype) < _precision_rank(promised):
                text = f"{dtype} inputs: {name} returned as {got_dtype} (less precise)"
                if kind in _OTB_KINDS and got_dtype == "float32" and dtype == "float64":
                    text += (" — an adapter is held to float64 for float64 inputs (its --working-dtype is a floor, "
                             "not a ceiling)" if subject.dtype_rule == "at-least" else
                             " — a target computing in float32 whatever its inputs is judged by float32's bound with "
                             "--working-dtype float32 (working_dtype='float32')")
                explained = next((d for d in deviations if d.structure is not None
                                  and d.structure("dtypes", case, name, got_dtype)), None)
                if explained is None:
                    problems["dtypes"].append(text)
                else:
                    documented["dtypes"].append((text, explained))
            elif subject.dtype_rule == "same" and got_dtype != dtype and got_dtype != promised:
                notes["dtypes"].append(f"{dtype} inputs: {name} returned as {got_dtype} (more precise than the input; "
                                       "verl returns the input's dtype)")
            again = second.outputs.get(name)
            if again is not None and not np.array_equal(value, again, equal_nan=True):
                if again.shape != value.shape or name not in drift or not drift[name].ok:
                    problems["deterministic"].append(f"{dtype}: {name} differs between two identical calls by more "
                                                     "than rounding")
                else:
                    notes["deterministic"].append(f"{dtype}: {name} differs between two identical calls in the last "
                                                  "bits (within rounding: a nondeterministic reduction order)")
        if not first.output_devices <= first.input_devices:
            problems["devices"].append(f"{dtype}: outputs on {sorted(first.output_devices)}, inputs on "
                                       f"{sorted(first.input_devices)}")
        if first.mutated:
            problems["inputs-unchanged"].append(f"{dtype}: the call modified {', '.join(first.mutated)}")
    rule = {"same": "outputs in the input dtype", "at-least": "outputs at least as precise as the inputs"}
    titles = {"runs": f"runs on {', '.join(dtypes)} inputs", "shapes": "outputs have the inputs' shape",
              "dtypes": rule[subject.dtype_rule], "devices": "outputs on the inputs' device",
              "inputs-unchanged": "inputs not modified (every later call is checked too)",
              "deterministic": "two identical calls, identical outputs"}
    results = []
    for name in names:
        found, noted, explained = problems[name], notes[name], documented[name]
        if name != "runs" and not returned:          # nothing came back: nothing to judge, not a pass
            results.append(CheckResult(f"{kind}/structure/{name}", "structure", kind, "skip",
                                       f"not checked: the target returned on no input ({titles[name]})",
                                       case=base.describe()))
            continue
        status = "fail" if found else ("warn" if noted else "pass")
        result = CheckResult(f"{kind}/structure/{name}", "structure", kind, status,
                             "; ".join(found or noted) if (found or noted) else titles[name], case=base.describe(),
                             ratio=math.inf if found else 0.0)
        if explained and not found:
            deviation = explained[0][1]
            what = "; ".join(text for text, _ in explained)
            result.deviation = deviation.id
            if session.strict:
                result.status, result.ratio = "fail", math.inf
                result.message = (f"{what} — documented deviation {deviation.id} ({deviation.category}); failed "
                                  "because of --strict")
            else:
                result.status = "deviation"
                result.message = (f"documented deviation {deviation.id} ({deviation.category}): {what}, as verl does "
                                  f"— {deviation.title}; the reference: {deviation.reference}")
        if name == "runs" and found:
            result.snippet = snippets.get("runs", "")
            result.call, result.traceback = details.get("runs", ("", ""))
        results.append(result)
    results[0].seconds = time.perf_counter() - start
    return results


# After the first failing example, the shrinker may run this many more candidates (the default budget); then shrinking
# stops and the report shows the last failing case, the smallest found so far (the shrinker only tries candidates
# simpler than its current best). Every case reported has failed when run. The budget is a count, not a time, so a
# seed replays the same report on any machine — given the same Hypothesis version, which also mixes constants found
# in the loaded local modules into its draws.
SHRINK_BUDGET = 200


class _ShrinkBudgetSpent(BaseException):
    """Stops the Hypothesis run (a BaseException, which Hypothesis does not treat as a test failure)."""


def _fingerprint(case: Case) -> str:
    import hashlib

    digest = hashlib.sha256(repr((case.kind, case.dtype, case.handle_zero_tail, case.epsilon, case.temperature)
                                 ).encode())
    for name in ("rewards", "response_mask", "log_probs", "sum_pi_squared", "is_weights", "logits", "hidden",
                 "weight", "token_ids", "log_probs_cotangent", "entropy_cotangent"):
        value = getattr(case, name)
        digest.update(b"-" if value is None else repr(value.shape).encode() + value.tobytes())
    digest.update(repr(None if case.group_ids is None else case.group_ids.tolist()).encode())
    return digest.hexdigest()


class _Nonconformant(Exception):
    """Raised inside the Hypothesis test when a generated case fails (carries nothing: the case is recorded)."""


@contextlib.contextmanager
def _private_hypothesis_storage():
    """Point Hypothesis's storage directory (where it caches, e.g., the constants it collects from loaded modules) at
    a temporary directory for the duration, so that ``verify`` writes no ``.hypothesis/`` into the user's working
    directory; the previous setting is restored afterwards."""
    from hypothesis import configuration

    previous = getattr(configuration, "__hypothesis_home_directory", None)
    with tempfile.TemporaryDirectory(prefix="otb-spec-hypothesis-") as directory:
        configuration.set_hypothesis_home_dir(directory)
        try:
            yield
        finally:
            configuration.set_hypothesis_home_dir(previous)


def _generated_check(session: _Session, kind: str, profile: str, max_examples: int, seed: int,
                     shrink_budget: int, deviations: tuple[Deviation, ...] = ()) -> CheckResult:
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Flaky

    start = time.perf_counter()
    subject = session.subject
    check_id = f"{kind}/generated/{profile}"
    dtypes = tuple(dtype for dtype in _VALUE_DTYPES if subject.supports_dtype(dtype))
    strategy = generated_cases(kind, profile=profile, dtypes=dtypes, equal_groups=subject.equal_groups,
                               fixed_shapes=subject.fixed_shapes)
    state: dict[str, Any] = {"examples": 0, "failure": None, "after_failure": 0, "failed": set(), "worst": None,
                             "deviating": {}}

    def fails(case: Case) -> bool:
        key = _fingerprint(case)
        if key in state["failed"]:                       # Hypothesis replaying a case already seen to fail
            return True
        if state["failure"] is not None:
            state["after_failure"] += 1
            if state["after_failure"] > shrink_budget:
                raise _ShrinkBudgetSpent                 # stop Hypothesis; the last failure is the smallest yet
        if session.hung:
            raise _ShrinkBudgetSpent
        state["examples"] += 1
        session.tell(f"{kind} generated {profile} {state['examples']}/{max_examples}")
        result = _value_check(session, case, check_id, "generated", snippet=False, deviations=deviations)
        state["last"] = result.comparisons
        if result.status == "deviation" or (result.status == "fail" and result.deviation):
            state["deviating"].setdefault(result.deviation, []).append(case.dtype)
        if result.status == "fail":
            state["failure"] = (case, result)
            state["failed"].add(key)
            if state["worst"] is None or result.ratio > state["worst"][1].ratio:
                state["worst"] = (case, result)
        return result.status == "fail"

    def body(case: Case) -> None:
        if fails(case):
            raise _Nonconformant                         # one raise site: Hypothesis sees one kind of failure

    test = settings(max_examples=max_examples, database=None, deadline=None, derandomize=False,
                    verbosity=Verbosity.quiet, report_multiple_bugs=False, print_blob=False,
                    suppress_health_check=list(HealthCheck),
                    phases=(Phase.explicit, Phase.generate, Phase.shrink))(given(strategy)(body))
    test = hypothesis_seed(seed)(test)
    flaky = ""
    with _private_hypothesis_storage():
        try:
            test()
        except (_Nonconformant, _ShrinkBudgetSpent):
            pass
        except Flaky as exc:
            flaky = f" (Hypothesis reports the failure as flaky — the implementation may be nondeterministic: {exc})"
    description = GENERATED_PROFILES[kind][profile][0]
    if state["failure"] is None and state["deviating"]:
        identifier, dtypes_seen = next(iter(state["deviating"].items()))
        deviation = next(d for d in deviations if d.id == identifier)
        result = CheckResult(check_id, "generated", kind, "deviation",
                             f"documented deviation {deviation.id} ({deviation.category}): {len(dtypes_seen)} of "
                             f"{state['examples']} generated cases ({', '.join(sorted(set(dtypes_seen)))}) differ "
                             f"from the reference exactly as verl does — {deviation.title}; the others agree with the "
                             f"reference (seed {seed})", case=f"profile {profile}: {description}",
                             examples=state["examples"], deviation=deviation.id,
                             comparisons=list(state.get("last", [])))      # the last example's
    elif state["failure"] is None:
        result = CheckResult(check_id, "generated", kind, "pass",
                             f"{state['examples']} generated cases agree with the reference (seed {seed})",
                             case=f"profile {profile}: {description}", examples=state["examples"],
                             comparisons=list(state.get("last", [])))      # the last example's
    else:
        case, result = state["failure"]
        worst_case, worst = state["worst"]
        how = (f"shrunk by Hypothesis within {shrink_budget} further runs" if shrink_budget else "not shrunk")
        result.message = f"failing case ({how}; seed {seed}): {result.message}{flaky}"
        if worst is not result and worst.ratio > result.ratio:
            shown = next((c.describe() for c in worst.comparisons if not c.ok), worst.message)
            result.message += (f" — the largest error among the failing examples was {_ratio(worst.ratio)} the "
                               f"allowed error, on {worst_case.describe()}: {shown}")
        result.ratio = max(result.ratio, worst.ratio)
        result.case = f"{result.case} (profile {profile})"
        result.snippet = subject.snippet(case)
        result.examples = state["examples"]
    result.seconds = time.perf_counter() - start
    return result


def _robustness_check(session: _Session, case: Case, check_id: str) -> CheckResult:
    """A value check whose failure is a warning: the inputs are ones no trainer produces (a call that writes into its
    inputs still fails)."""
    return _value_check(session, case, check_id, "robustness", snippet=False, differences_warn=True)


def run_checks(subject: Subject, kind: str, *, max_examples: int = 100, seed: int = 0,
               layers: Iterable[str] = LAYERS, skips: Iterable[tuple[str, str]] = (),
               shrink_budget: int = SHRINK_BUDGET, strict: bool = False, timeout: float | None = DEFAULT_TIMEOUT,
               progress: Callable[[str], None] | None = None, fail_fast: bool = False) -> list[CheckResult]:
    """Run the layers of checks for one kind on a subject; returns every check's result, in order.

    A failing signature check stops the run (nothing else can be called); so does a call that does not return within
    ``timeout`` seconds (None or 0: no limit). ``skips`` are ``(pattern, reason)`` pairs matched against check ids
    (:func:`read_skip_file`). ``shrink_budget``: how many more runs Hypothesis may spend shrinking a failing generated
    case (0: report the first failure as found). ``strict``: a documented deviation from verl is a failure.
    ``progress`` is called with a short label before each check. ``fail_fast``: stop after the first failing check
    (the verdict is then known; the report lists the checks run so far).
    """
    if not isinstance(max_examples, int) or max_examples < 1:
        raise ValueError(f"max_examples: expected a positive integer, got {max_examples!r}")
    if not isinstance(shrink_budget, int) or shrink_budget < 0:
        raise ValueError(f"shrink_budget: expected a non-negative integer, got {shrink_budget!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout < 0
                                or not math.isfinite(timeout)):
        raise ValueError(f"timeout: expected a non-negative number of seconds or None, got {timeout!r}")
    layers = tuple(layers)
    unknown = [layer for layer in layers if layer not in LAYERS]
    if unknown:
        raise ValueError(f"layers: unknown {', '.join(unknown)}; expected some of {', '.join(LAYERS)}")
    skips = list(skips)
    session = _Session(subject, timeout, strict, progress)
    deviations = deviations_for(kind)
    results: list[CheckResult] = []

    matched: set[str] = set()

    def skipped(check_id: str, layer: str) -> bool:
        reason = _skip_reason(check_id, skips)
        if reason is not None:
            matched.update(pattern for pattern, _ in skips if fnmatch.fnmatchcase(check_id, pattern))
            results.append(CheckResult(check_id, layer, kind, "skip", f"skipped: {reason}"))
        return reason is not None

    def unmatched_skips() -> list[CheckResult]:
        """A warning for each skip pattern of this kind that matched no check of the complete run (a typo skips
        nothing, silently)."""
        if stop():
            return []
        return [CheckResult(f"{kind}/skip-file", "signature", kind, "warn",
                            f"the skip pattern {pattern!r} ({reason}) matched no check of this run: a typo? "
                            "(--verbose lists the check ids)")
                for pattern, reason in skips
                if pattern not in matched and fnmatch.fnmatchcase(kind, pattern.split("/", 1)[0])]

    if "signature" in layers and not skipped(f"{kind}/signature", "signature"):
        problem = subject.signature_problem(kind)
        note = None if problem else subject.signature_note(kind)
        results.append(CheckResult(f"{kind}/signature", "signature", kind,
                                   "fail" if problem else "warn" if note else "pass",
                                   problem or note or "callable as the convention requires",
                                   ratio=math.inf if problem else 0))
        if problem:
            return results
    def stop() -> bool:
        return bool(session.hung) or (fail_fast and any(result.status == "fail" for result in results))

    if "structure" in layers:
        for result in _structure_checks(session, kind, deviations):
            if not skipped(result.id, "structure"):
                results.append(result)
    sources = {"golden": lambda: golden_cases(kind, _VALUE_DTYPES),
               "special": lambda: special_cases(kind, equal_groups=subject.equal_groups),
               "robustness": lambda: robustness_cases(kind)}
    for layer in LAYERS[2:]:
        if layer not in layers or stop():
            continue
        if layer == "generated":
            for profile in GENERATED_PROFILES[kind]:
                if not stop() and not skipped(f"{kind}/generated/{profile}", layer):
                    results.append(_generated_check(session, kind, profile, max_examples, seed, shrink_budget,
                                                    deviations))
            continue
        cases = sources[layer]()
        for number, case in enumerate(cases, 1):
            if stop():
                break
            check_id = f"{kind}/{layer}/{_slug(case.name)}/{case.dtype}"
            if skipped(check_id, layer):
                continue
            if not subject.supports_dtype(case.dtype):
                results.append(CheckResult(check_id, layer, kind, "skip",
                                           f"the convention cannot deliver {case.dtype} inputs here"))
                continue
            session.tell(f"{kind} {layer} {number}/{len(cases)}")
            if layer == "robustness":
                results.append(_robustness_check(session, case, check_id))
            else:
                results.append(_value_check(session, case, check_id, layer, deviations=deviations))
    return results + unmatched_skips()
