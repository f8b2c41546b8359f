"""The verification report: what ran, what failed and why — as text for people and JSON for scripts."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass, field

from otb_spec._version import __version__
from otb_spec.conformance._checks import LAYERS, CheckResult

__all__ = ["Report", "REPORT_SCHEMA", "REPORT_SCHEMA_VERSION"]

REPORT_SCHEMA = "otb-spec-verify-report"
REPORT_SCHEMA_VERSION = 1


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

    @property
    def failures(self) -> list[CheckResult]:
        return [result for result in self.results if result.status == "fail"]

    @property
    def conformant(self) -> bool:
        """No check failed, and at least one value check passed."""
        values = [r for r in self.results if r.layer in ("golden", "generated", "special") and r.status == "pass"]
        return not self.failures and bool(values)

    @property
    def exit_status(self) -> int:
        """0 conformant, 1 not conformant (2 — usage or import errors — never gets as far as a report)."""
        return 0 if self.conformant else 1

    def to_json(self) -> dict:
        """The machine-readable report (schema ``otb-spec-verify-report``, version 1)."""
        import hypothesis
        import numpy

        return {
            "schema": REPORT_SCHEMA,
            "schema_version": REPORT_SCHEMA_VERSION,
            "otb_spec_version": __version__,
            "versions": {"python": platform.python_version(), "numpy": numpy.__version__,
                         "hypothesis": hypothesis.__version__},
            "target": self.target,
            "convention": self.convention,
            "subject": self.subject,
            "kinds": list(self.kinds),
            "device": self.device,
            "seed": self.seed,
            "max_examples": self.max_examples,
            "conformant": self.conformant,
            "exit_status": self.exit_status,
            "seconds": round(self.seconds, 3),
            "summary": self._summary(),
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
                                                  for status in ("pass", "fail", "skip")}
        return summary

    def to_text(self, *, verbose: bool = False) -> str:
        """The human report: header, a line per kind and layer, then the failures — the first of each layer with its
        case and reproduction, the others in a line or two (``verbose``: all in full, passing checks too)."""
        lines = [f"otb-spec {__version__} — conformance of an OTB implementation to the reference",
                 f"target:      {self.target}",
                 f"subject:     {self.subject}",
                 f"kinds:       {', '.join(self.kinds)}",
                 f"generated:   Hypothesis, seed {self.seed}, up to {self.max_examples} examples per generated profile",
                 "tolerances:  otb_spec.tolerances (per element, from dtype and problem size; docs/tolerances.md)",
                 ""]
        for key, counts in self._summary().items():
            verdict = "FAIL" if counts["fail"] else ("PASS" if counts["pass"] else "SKIP")
            total = counts["pass"] + counts["fail"]
            extra = f", {counts['skip']} skipped" if counts["skip"] else ""
            lines.append(f"  {key:<24} {verdict}  {counts['pass']}/{total} passed{extra}")
        lines.append("")
        detailed: set[str] = set()
        for result in self.results:
            if result.status == "pass" and not verbose:
                continue
            first_of_layer = (result.kind, result.layer) not in detailed
            if result.status == "fail":
                detailed.add((result.kind, result.layer))
            lines += _describe(result, full=verbose or first_of_layer)
        failed = len(self.failures)
        checks = sum(r.status != "skip" for r in self.results)
        if self.conformant:
            lines.append(f"RESULT: CONFORMANT — {checks} checks passed in {self.seconds:.1f} s")
        elif failed:
            lines.append(f"RESULT: NOT CONFORMANT — {failed} of {checks} checks failed ({self.seconds:.1f} s)")
        else:
            lines.append("RESULT: NOT CONFORMANT — no value check ran (every one was skipped)")
        return "\n".join(lines)


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
    if result.status == "fail":
        for comparison in result.comparisons:
            if not comparison.ok:
                lines.append(f"  {comparison.describe()}")
    if result.snippet:
        lines.append("  reproduce:")
        lines += ["    " + line for line in result.snippet.splitlines()]
    lines.append("")
    return lines
