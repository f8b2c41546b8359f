"""The layered checks, in the order a standards conformance suite runs them.

1. **signature** — the target can be called the way its convention says;
2. **structure** — on one ordinary case in every dtype the convention delivers: it runs, outputs have the input's
   shape, the convention's dtype rule holds, outputs stay on the inputs' device, inputs are not modified, and a second
   call gives bit-identical outputs;
3. **golden** — hand-built cases, each isolating one behaviour real implementations get wrong;
4. **generated** — Hypothesis-generated cases (seeded; a failure is shrunk to a minimal case);
5. **special** — long sequences and large or extreme inputs, where low-precision accumulation shows.

Every value check compares each output with the reference elementwise, within the per-element tolerance of
:meth:`Case.tolerances` (``otb_spec.tolerances`` — one documented place); an output that is NaN or ±inf where the
reference is finite is always a failure.
"""

from __future__ import annotations

import fnmatch
import math
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import numpy as np

from otb_spec.conformance._cases import GENERATED_PROFILES, Case, generated_cases, golden_cases, special_cases
from otb_spec.conformance._conventions import Subject
from otb_spec.tolerances import machine_epsilon

__all__ = ["LAYERS", "SHRINK_BUDGET", "Comparison", "CheckResult", "compare", "run_checks", "read_skip_file"]

LAYERS = ("signature", "structure", "golden", "generated", "special")
_STRUCTURE_DTYPES = ("float64", "float32", "bfloat16")
_VALUE_DTYPES = ("float64", "float32")


@dataclass
class Comparison:
    """One output compared with the reference.

    ``max_abs_error`` and ``max_rel_error`` are over the elements with a finite tolerance (``checked_fraction`` of
    them; the rest are ill-conditioned); ``worst_*`` describe the element furthest outside its tolerance (or closest
    to it, when all pass), ``allowed`` its tolerance ``atol + rtol·|expected|``.
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

    @property
    def ok(self) -> bool:
        return not self.shape_problem and self.violations == 0

    def describe(self) -> str:
        if self.shape_problem:
            return f"{self.output}: {self.shape_problem}"
        where = "" if self.worst_index is None else (
            f"; worst at {self.worst_index}: got {_number(self.worst_got)}, expected {_number(self.worst_expected)}"
            f" (|Δ| = {_number(abs(self.worst_got - self.worst_expected)) if _finite(self.worst_got) else 'nan'},"
            f" allowed {_number(self.worst_allowed)})")
        head = (f"{self.output}: {self.violations} of {self.size} elements outside tolerance" if self.violations
                else f"{self.output}: all {self.size} elements within tolerance")
        return (f"{head}{where}; max abs error {_number(self.max_abs_error)}, max rel error "
                f"{_number(self.max_rel_error)} over {self.checked_fraction:.0%} checked elements; tolerance: "
                f"{self.tolerance_reason}")


@dataclass
class CheckResult:
    """The result of one check. ``status``: ``"pass"``, ``"fail"`` or ``"skip"``."""

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

    def to_dict(self) -> dict:
        data = asdict(self)
        data["comparisons"] = [dict(asdict(c), ok=c.ok) for c in self.comparisons]
        return _json_safe(data)


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(value)


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.6g}"


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
            compute_dtype: str | None = None) -> list[Comparison]:
    """Compare an implementation's outputs on ``case`` with the reference, output by output.

    Args:
      case: the conformance case.
      outputs: ``{"advantages": …, "returns": …}`` (OTB kinds) or ``{"sum_pi_squared": …}``, any array-likes.
      output_dtypes: the dtype name of each output as the implementation returned it (its rounding is allowed for);
        default the case's dtype.
      compute_dtype: the precision the implementation accumulates in; default float64 for float64 inputs, float32
        otherwise.
    """
    expected = case.expected()
    comparisons = []
    for name in case.output_names:
        dtype = (output_dtypes or {}).get(name) or case.dtype
        try:
            machine_epsilon(dtype)
        except ValueError:
            dtype = case.dtype                                   # an integer or unknown dtype: judged by the values
        tolerance = case.tolerances(output_dtype=dtype, compute_dtype=compute_dtype)[name]
        want = np.asarray(expected[name], dtype=np.float64)
        if name not in outputs:
            comparisons.append(Comparison(name, want.size, want.size, math.inf, math.inf, 0.0, None, None, None,
                                          None, tolerance.reason, shape_problem="missing from the outputs"))
            continue
        try:
            got = np.asarray(outputs[name], dtype=np.float64)
        except (TypeError, ValueError) as exc:
            comparisons.append(Comparison(name, want.size, want.size, math.inf, math.inf, 0.0, None, None, None,
                                          None, tolerance.reason, shape_problem=f"not a numeric array ({exc})"))
            continue
        if got.shape != want.shape:
            comparisons.append(Comparison(name, want.size, want.size, math.inf, math.inf, 0.0, None, None, None,
                                          None, tolerance.reason,
                                          shape_problem=f"shape {got.shape}, expected {want.shape}"))
            continue
        comparisons.append(_compare_values(name, got, want, tolerance))
    return comparisons


def _compare_values(name: str, got: np.ndarray, want: np.ndarray, tolerance) -> Comparison:
    allowed = np.broadcast_to(np.asarray(tolerance.atol, dtype=np.float64)
                              + np.asarray(tolerance.rtol, dtype=np.float64) * np.abs(want), want.shape)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        error = np.nan_to_num(np.abs(got - want), nan=np.inf)           # NaN output: infinitely wrong
        checked = np.isfinite(allowed)
        not_finite = ~np.isfinite(got) & np.isfinite(want)
        considered = checked | not_finite
        bad = not_finite | (checked & (error > allowed))
        excess = np.where(allowed > 0, error / np.where(allowed > 0, allowed, 1.0), np.where(error > 0, np.inf, 0.0))
        excess = np.where(not_finite, np.inf, np.where(checked, excess, -np.inf))
        relative = np.where(want != 0, error / np.abs(np.where(want != 0, want, 1.0)), np.where(error > 0, np.inf, 0.0))
    worst = None
    if want.size and considered.any():
        worst = tuple(int(i) for i in np.unravel_index(int(np.argmax(excess)), want.shape))
    pick = (lambda a: float(a[worst])) if worst is not None else (lambda a: None)
    return Comparison(
        name, int(bad.sum()), int(want.size), float(np.max(np.where(considered, error, 0.0), initial=0.0)),
        float(np.max(np.where(considered, relative, 0.0), initial=0.0)), float(checked.mean()) if want.size else 1.0,
        worst, pick(got), pick(want), pick(allowed), tolerance.reason)


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
# the layers


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower().replace("ε", "epsilon").replace("ρ", "rho").replace("σ", "sigma")
                  .replace("π", "pi").replace("±", "pm").replace("²", "2").replace("→", "to")).strip("-")


def _value_check(subject: Subject, case: Case, check_id: str, layer: str, snippet: bool = True) -> CheckResult:
    start = time.perf_counter()
    result = CheckResult(check_id, layer, case.kind, "pass", case=case.describe(), note=case.note)
    reason = subject.expressible(case)
    if reason:
        result.status, result.message = "skip", f"not expressible in this convention: {reason}"
        return result
    try:
        outcome = subject.run(case)
    except Exception as exc:  # the implementation's own error is a finding, whatever its type
        result.status, result.message = "fail", f"raised {type(exc).__name__}: {exc}"
    else:
        result.comparisons = compare(case, outcome.outputs, output_dtypes=outcome.output_dtypes,
                                     compute_dtype=subject.compute_dtype(case.dtype))
        failed = [c for c in result.comparisons if not c.ok]
        if failed:
            result.status = "fail"
            result.message = "; ".join(f"{c.output} differs from the reference" if not c.shape_problem else
                                       f"{c.output}: {c.shape_problem}" for c in failed)
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


def _structure_checks(subject: Subject, kind: str) -> list[CheckResult]:
    start = time.perf_counter()
    base = _probe_case(kind)
    if subject.equal_groups and kind != "sum-pi-squared":
        base = next(case for case in golden_cases(kind, ("float64",)) if subject.expressible(case) is None)
    dtypes = [dtype for dtype in _STRUCTURE_DTYPES if subject.supports_dtype(dtype)]
    problems: dict[str, list[str]] = {name: [] for name in ("runs", "shapes", "dtypes", "devices", "inputs-unchanged",
                                                              "deterministic")}
    snippets: dict[str, str] = {}
    for dtype in dtypes:
        case = base.with_dtype(dtype)
        try:
            first = subject.run(case)
            second = subject.run(case)
        except Exception as exc:
            problems["runs"].append(f"{dtype}: raised {type(exc).__name__}: {exc}")
            snippets.setdefault("runs", subject.snippet(case))
            continue
        shape = case.logits.shape[:-1] if kind == "sum-pi-squared" else case.rewards.shape
        for name in case.output_names:
            value = first.outputs.get(name)
            if value is None:
                problems["shapes"].append(f"{dtype}: output {name} missing")
                continue
            if tuple(value.shape) != tuple(shape):
                problems["shapes"].append(f"{dtype}: {name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
            got_dtype = first.output_dtypes.get(name, "?")
            if subject.dtype_rule == "same" and got_dtype != dtype:
                problems["dtypes"].append(f"{dtype} inputs: {name} returned as {got_dtype}")
            elif subject.dtype_rule == "at-least" and _precision_rank(got_dtype) < _precision_rank(dtype):
                problems["dtypes"].append(f"{dtype} inputs: {name} returned as {got_dtype} (less precise)")
            if not np.array_equal(value, second.outputs.get(name), equal_nan=True):
                problems["deterministic"].append(f"{dtype}: {name} differs between two identical calls")
        if not first.output_devices <= first.input_devices:
            problems["devices"].append(f"{dtype}: outputs on {sorted(first.output_devices)}, inputs on "
                                       f"{sorted(first.input_devices)}")
        if first.mutated:
            problems["inputs-unchanged"].append(f"{dtype}: the call modified {', '.join(first.mutated)}")
    rule = {"same": "outputs in the input dtype", "at-least": "outputs at least as precise as the inputs"}
    titles = {"runs": f"runs on {', '.join(dtypes)} inputs", "shapes": "outputs have the inputs' shape",
              "dtypes": rule[subject.dtype_rule], "devices": "outputs on the inputs' device",
              "inputs-unchanged": "inputs not modified", "deterministic": "two identical calls, identical outputs"}
    results = []
    for name, found in problems.items():
        result = CheckResult(f"{kind}/structure/{name}", "structure", kind, "fail" if found else "pass",
                             "; ".join(found) if found else titles[name], case=base.describe())
        if name == "runs" and found:
            result.snippet = snippets.get("runs", "")
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

    digest = hashlib.sha256(repr((case.kind, case.dtype, case.handle_zero_tail, case.epsilon)).encode())
    for name in ("rewards", "response_mask", "log_probs", "sum_pi_squared", "is_weights", "logits"):
        value = getattr(case, name)
        digest.update(b"-" if value is None else repr(value.shape).encode() + value.tobytes())
    digest.update(repr(None if case.group_ids is None else case.group_ids.tolist()).encode())
    return digest.hexdigest()


class _Nonconformant(Exception):
    """Raised inside the Hypothesis test when a generated case fails (carries nothing: the case is recorded)."""


def _generated_check(subject: Subject, kind: str, profile: str, max_examples: int, seed: int,
                     shrink_budget: int) -> CheckResult:
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Flaky

    start = time.perf_counter()
    check_id = f"{kind}/generated/{profile}"
    dtypes = tuple(dtype for dtype in _VALUE_DTYPES if subject.supports_dtype(dtype))
    strategy = generated_cases(kind, profile=profile, dtypes=dtypes, equal_groups=subject.equal_groups)
    state: dict[str, Any] = {"examples": 0, "failure": None, "after_failure": 0, "failed": set()}

    def fails(case: Case) -> bool:
        key = _fingerprint(case)
        if key in state["failed"]:                       # Hypothesis replaying a case already seen to fail
            return True
        if state["failure"] is not None:
            state["after_failure"] += 1
            if state["after_failure"] > shrink_budget:
                raise _ShrinkBudgetSpent                 # stop Hypothesis; the last failure is the smallest yet
        state["examples"] += 1
        result = _value_check(subject, case, check_id, "generated", snippet=False)
        if result.status == "fail":
            state["failure"] = (case, result)
            state["failed"].add(key)
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
    try:
        test()
    except (_Nonconformant, _ShrinkBudgetSpent):
        pass
    except Flaky as exc:
        flaky = f" (Hypothesis reports the failure as flaky — the implementation may be nondeterministic: {exc})"
    description = GENERATED_PROFILES[kind][profile][0]
    if state["failure"] is None:
        result = CheckResult(check_id, "generated", kind, "pass",
                             f"{state['examples']} generated cases agree with the reference (seed {seed})",
                             case=f"profile {profile}: {description}", examples=state["examples"])
    else:
        case, result = state["failure"]
        how = (f"shrunk by Hypothesis within {shrink_budget} further runs" if shrink_budget else "not shrunk")
        result.message = f"failing case ({how}; seed {seed}): {result.message}{flaky}"
        result.case = f"{result.case} (profile {profile})"
        result.snippet = subject.snippet(case)
        result.examples = state["examples"]
    result.seconds = time.perf_counter() - start
    return result


def run_checks(subject: Subject, kind: str, *, max_examples: int = 100, seed: int = 0,
               layers: Iterable[str] = LAYERS, skips: Iterable[tuple[str, str]] = (),
               shrink_budget: int = SHRINK_BUDGET) -> list[CheckResult]:
    """Run the layers of checks for one kind on a subject; returns every check's result, in order.

    A failing signature check stops the run (nothing else can be called). ``skips`` are ``(pattern, reason)`` pairs
    matched against check ids (:func:`read_skip_file`). ``shrink_budget``: how many more runs Hypothesis may spend
    shrinking a failing generated case (0: report the first failure as found).
    """
    if not isinstance(max_examples, int) or max_examples < 1:
        raise ValueError(f"max_examples: expected a positive integer, got {max_examples!r}")
    if not isinstance(shrink_budget, int) or shrink_budget < 0:
        raise ValueError(f"shrink_budget: expected a non-negative integer, got {shrink_budget!r}")
    layers = tuple(layers)
    unknown = [layer for layer in layers if layer not in LAYERS]
    if unknown:
        raise ValueError(f"layers: unknown {', '.join(unknown)}; expected some of {', '.join(LAYERS)}")
    skips = list(skips)
    results: list[CheckResult] = []

    def skipped(check_id: str, layer: str) -> bool:
        reason = _skip_reason(check_id, skips)
        if reason is not None:
            results.append(CheckResult(check_id, layer, kind, "skip", f"skipped: {reason}"))
        return reason is not None

    if "signature" in layers and not skipped(f"{kind}/signature", "signature"):
        problem = subject.signature_problem(kind)
        results.append(CheckResult(f"{kind}/signature", "signature", kind, "fail" if problem else "pass",
                                   problem or "callable as the convention requires"))
        if problem:
            return results
    if "structure" in layers:
        for result in _structure_checks(subject, kind):
            if not skipped(result.id, "structure"):
                results.append(result)
    for layer, cases in (("golden", lambda: golden_cases(kind, _VALUE_DTYPES)), ("generated", None),
                         ("special", lambda: special_cases(kind, equal_groups=subject.equal_groups))):
        if layer not in layers:
            continue
        if layer == "generated":
            for profile in GENERATED_PROFILES[kind]:
                if not skipped(f"{kind}/generated/{profile}", layer):
                    results.append(_generated_check(subject, kind, profile, max_examples, seed, shrink_budget))
            continue
        for case in cases():
            check_id = f"{kind}/{layer}/{_slug(case.name)}/{case.dtype}"
            if skipped(check_id, layer):
                continue
            if not subject.supports_dtype(case.dtype):
                results.append(CheckResult(check_id, layer, kind, "skip",
                                           f"the convention cannot deliver {case.dtype} inputs here"))
                continue
            results.append(_value_check(subject, case, check_id, layer))
    return results
