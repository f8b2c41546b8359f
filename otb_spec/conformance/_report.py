"""The verification report: what ran, what failed and why — as text for people and JSON for scripts.

The verdict is one of ``CONFORMANT``, ``CONFORMANT WITH N DOCUMENTED DEVIATIONS`` (N documented deviations of verl
0.9.1 observed; they do not fail the verdict unless ``strict``) and ``NOT CONFORMANT``; it is the first line of the
text report and the ``verdict`` field of the JSON report.
"""

from __future__ import annotations

import json
import math
import platform
from dataclasses import dataclass, field

from otb_spec._version import __version__
from otb_spec.conformance._checks import LAYERS, STATUSES, CheckResult
from otb_spec.conformance._deviations import Deviation, deviations_for

__all__ = ["Report", "REPORT_SCHEMA", "REPORT_SCHEMA_VERSION"]

REPORT_SCHEMA = "otb-spec-verify-report"
REPORT_SCHEMA_VERSION = 2


@dataclass
class Report:
    """Everything one ``verify`` run found.

    Attributes:
      target: how the implementation was named (``"pkg.mod:fn"``, ``"file.py:fn"``, ``"adapter torch-cpu"``).
      convention: the calling convention (``"verl"``, ``"numpy"``, …, or ``"adapter"``).
      subject: the subject's description (target, convention, device).
      kinds: the kinds checked.
      device: where inputs were placed.
      seed, max_examples: the Hypothesis settings of the generated layer.
      results: every check's :class:`CheckResult`, in the order run.
      seconds: wall time of the whole run.
      strict: documented deviations of verl were counted as failures.
      notes: header lines from the subject — how it was called, how gradients were taken (or that they were not),
        which bound judged it (fused token statistics).
    """

    target: str
    convention: str
    subject: str
    kinds: tuple[str, ...]
    device: str
    seed: int
    max_examples: int
    results: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0
    strict: bool = False
    notes: tuple[str, ...] = ()

    @property
    def compared_outputs(self) -> list[str]:
        """The outputs some value check compared with the reference, in order of first appearance."""
        seen = [c.output for r in self.results for c in r.comparisons]
        return list(dict.fromkeys(seen))

    def _output_lines(self) -> list[str]:
        """Fused token statistics: which outputs were compared, and which optional ones were not."""
        if "fused-token-statistics" not in self.kinds or not self.compared_outputs:
            return []
        compared = self.compared_outputs
        missing = [name for name in ("sum_pi_squared", "grad_hidden", "grad_weight") if name not in compared]
        why = {"sum_pi_squared": "not returned by the target", "grad_hidden": "no gradients taken",
               "grad_weight": "no gradients taken"}
        text = f"outputs:     compared {', '.join(compared)}"
        if missing:
            text += "; NOT CHECKED: " + ", ".join(f"{name} ({why[name]})" for name in missing)
        return [text]

    @property
    def failures(self) -> list[CheckResult]:
        return [result for result in self.results if result.status == "fail"]

    @property
    def deviations(self) -> list[CheckResult]:
        """Checks that differ from the reference exactly as a documented deviation of verl does."""
        return [result for result in self.results if result.status == "deviation"]

    @property
    def warnings(self) -> list[CheckResult]:
        return [result for result in self.results if result.status == "warn"]

    @property
    def catalogue(self) -> tuple[Deviation, ...]:
        """The documented deviations that concern the kinds checked (listed in every report, observed or not)."""
        seen: dict[str, Deviation] = {}
        for kind in self.kinds:
            for deviation in deviations_for(kind):
                seen.setdefault(deviation.id, deviation)
        return tuple(seen.values())

    @property
    def observed_deviations(self) -> list[str]:
        """Ids of the documented deviations some check matched (with ``strict``: the failures they explain)."""
        matched = [r.deviation for r in self.results if r.deviation and r.status in ("deviation", "fail")]
        return list(dict.fromkeys(matched))

    @property
    def conformant(self) -> bool:
        """No check failed, and at least one value check passed."""
        values = [r for r in self.results if r.layer in ("golden", "generated", "special") and r.status == "pass"]
        return not self.failures and bool(values)

    @property
    def verdict(self) -> str:
        """``CONFORMANT``, ``CONFORMANT WITH N DOCUMENTED DEVIATIONS`` (``… 1 DOCUMENTED DEVIATION``) or
        ``NOT CONFORMANT``."""
        if not self.conformant:
            return "NOT CONFORMANT"
        count = len({r.deviation for r in self.deviations})
        if not count:
            return "CONFORMANT"
        return f"CONFORMANT WITH {count} DOCUMENTED DEVIATION{'S' if count > 1 else ''}"

    @property
    def exit_status(self) -> int:
        """0 conformant (documented deviations included), 1 not conformant (2 — usage or import errors — never gets
        as far as a report)."""
        return 0 if self.conformant else 1

    def to_json(self) -> dict:
        """The machine-readable report (schema ``otb-spec-verify-report``, version 2)."""
        import hypothesis
        import numpy

        return {
            "schema": REPORT_SCHEMA,
            "schema_version": REPORT_SCHEMA_VERSION,
            "otb_spec_version": __version__,
            "versions": {"python": platform.python_version(), "numpy": numpy.__version__,
                         "hypothesis": hypothesis.__version__},
            "verdict": self.verdict,
            "target": self.target,
            "convention": self.convention,
            "subject": self.subject,
            "kinds": list(self.kinds),
            "device": self.device,
            "seed": self.seed,
            "max_examples": self.max_examples,
            "strict": self.strict,
            "conformant": self.conformant,
            "exit_status": self.exit_status,
            "seconds": round(self.seconds, 3),
            "notes": list(self.notes) + self._output_lines(),
            "compared_outputs": self.compared_outputs,
            "summary": self._summary(),
            "deviations": [dict(deviation.to_dict(), observed=deviation.id in self.observed_deviations,
                                checks=[r.id for r in self.results if r.deviation == deviation.id])
                           for deviation in self.catalogue],
            "checks": [result.to_dict() for result in self.results],
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_json(), handle, indent=2, ensure_ascii=False)
            handle.write("\n")

    def _summary(self) -> dict:
        summary = {}
        for kind in self.kinds:
            for layer in LAYERS:
                results = [r for r in self.results if r.kind == kind and r.layer == layer]
                if results:
                    summary[f"{kind}/{layer}"] = {status: sum(r.status == status for r in results)
                                                  for status in STATUSES}
        return summary

    def to_text(self, *, verbose: bool = False) -> str:
        """The human report: the verdict, a header, a line per kind and layer, then the failures — the one furthest
        outside its tolerance first and in full (case, reproduction), the others in a line or two (``verbose``: all
        in full, passing checks too) — the documented deviations and the warnings."""
        deviation_note = ("documented deviations of verl 0.9.1 are failures (--strict)" if self.strict else
                          "documented deviations of verl 0.9.1 are listed, not failed (--strict fails them)")
        lines = [self.verdict,
                 f"otb-spec {__version__} — conformance of an OTB implementation to the reference",
                 f"target:      {self.target}",
                 f"subject:     {self.subject}",
                 f"kinds:       {', '.join(self.kinds)}",
                 f"generated:   Hypothesis, seed {self.seed}, up to {self.max_examples} examples per generated profile",
                 "tolerances:  otb_spec.tolerances (per element, from the dtypes and the problem size; "
                 "docs/tolerances.md)",
                 f"deviations:  {deviation_note}",
                 *self.notes, *self._output_lines(),
                 ""]
        summary = self._summary()
        width = max([26] + [len(key) for key in summary])
        for key, counts in summary.items():
            if counts["fail"]:
                verdict = "FAIL"
            elif counts["deviation"]:
                verdict = "DEVIATES"
            elif counts["warn"]:
                verdict = "WARN"
            else:
                verdict = "PASS" if counts["pass"] else "SKIP"
            total = sum(counts[status] for status in ("pass", "fail", "deviation", "warn"))
            extra = "".join(f", {counts[status]} {label}{'s' if counts[status] != 1 and status != 'skip' else ''}"
                            for status, label in (("deviation", "documented deviation"), ("warn", "warning"),
                                                  ("skip", "skipped")) if counts[status])
            lines.append(f"  {key:<{width}} {verdict:<8} {counts['pass']}/{total} passed{extra}")
        lines.append("")
        failures = sorted(self.failures, key=lambda r: -(r.ratio if not math.isnan(r.ratio) else math.inf))
        if failures:
            worst = failures[0]
            lines.append(f"Furthest outside its tolerance ({_times(worst.ratio)} the allowed error):")
            lines += _describe(worst, full=True)
        detailed = {(failures[0].kind, failures[0].layer)} if failures else set()
        for result in self.results:
            if result.status in ("deviation", "warn") or (result.status in ("pass", "skip") and not verbose):
                continue
            if failures and result is failures[0]:
                continue
            first_of_layer = (result.kind, result.layer) not in detailed
            if result.status == "fail":
                detailed.add((result.kind, result.layer))
            lines += _describe(result, full=verbose or first_of_layer)
        lines += self._deviation_lines(verbose)
        if self.warnings:
            lines.append("WARNINGS (never a failure)")
            for result in self.warnings:
                lines.append(f"  WARN {result.id}: {result.message}")
            lines.append("")
        checks = sum(r.status != "skip" for r in self.results)
        if self.conformant:
            count = len(self.deviations)
            extra = f", {count} documented deviation{'s' if count != 1 else ''}" if count else ""
            extra += f", {len(self.warnings)} warning{'s' if len(self.warnings) != 1 else ''}" if self.warnings else ""
            lines.append(f"RESULT: {self.verdict} — {checks - count - len(self.warnings)} checks passed{extra} "
                         f"in {self.seconds:.1f} s")
        elif self.failures:
            lines.append(f"RESULT: NOT CONFORMANT — {len(self.failures)} of {checks} checks failed ({self.seconds:.1f} s)")
        else:
            lines.append("RESULT: NOT CONFORMANT — no value check passed: a verdict needs a golden, special or "
                         "generated check, and the layers run had none (or every one was skipped)")
        return "\n".join(lines)

    def _deviation_lines(self, verbose: bool) -> list[str]:
        if not self.catalogue:
            return [f"DOCUMENTED DEVIATIONS of verl 0.9.1 for {', '.join(self.kinds)}: none (docs/verl-differences.md)",
                    ""]
        lines = ["DOCUMENTED DEVIATIONS of verl 0.9.1 for " + ", ".join(self.kinds)
                 + " (docs/verl-differences.md; listed in every report)"]
        for deviation in self.catalogue:
            checks = [r for r in self.results if r.deviation == deviation.id]
            state = (f"observed in {len(checks)} check{'s' if len(checks) != 1 else ''}" if checks else
                     "not observed with this target")
            lines.append(f"  {deviation.id} [{deviation.category}] — {state}")
            lines.append(f"    {deviation.title}")
            if checks or verbose:
                lines.append(f"    verl:      {deviation.verl}")
                lines.append(f"    reference: {deviation.reference}")
                lines.append(f"    why:       {deviation.why} ({deviation.doc})")
            for result in checks:
                worst = next((c for c in result.comparisons if not c.ok), None)
                detail = f": {worst.describe()}" if worst is not None else f": {result.message}"
                lines.append(f"    - {result.id}{' (FAILED: --strict)' if result.status == 'fail' else ''}{detail}")
        lines.append("")
        return lines


def _times(ratio: float) -> str:
    """The ratio to the allowed error; above 1e30 the allowed error is an exact result's underflow allowance and the
    number says nothing more than "far outside"."""
    if not math.isfinite(ratio):
        return "∞×"
    return "over 1e30×" if ratio > 1e30 else f"{ratio:.3g}×"


def _describe(result: CheckResult, full: bool = True) -> list[str]:
    """A check's lines; ``full=False`` (later failures of a layer already shown in full): no case and snippet."""
    lines = [f"{result.status.upper()} {result.id}"]
    if not full:
        worst = next((c.describe() for c in result.comparisons if not c.ok), "")
        return lines + [f"  {result.message}"] + ([f"  {worst}"] if worst else []) + [
            "  (case and reproduction: --verbose, or --json)", ""]
    if result.message:
        lines.append(f"  {result.message}")
    if result.case:
        lines.append(f"  case: {result.case}")
    if result.note:
        lines.append(f"  note: {result.note}")
    if result.call:
        lines.append(f"  called as: target{result.call}")
    if result.traceback:
        lines.append("  traceback (the target's frames):")
        lines += ["    " + line for line in result.traceback.splitlines()]
    if result.status == "fail":
        for comparison in result.comparisons:
            if not comparison.ok:
                lines.append(f"  {comparison.describe()}")
    if result.snippet:
        lines.append("  reproduce:")
        lines += ["    " + line for line in result.snippet.splitlines()]
    lines.append("")
    return lines
