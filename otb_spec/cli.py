"""The ``otb-spec`` command.

    otb-spec --version
    otb-spec demo [--estimator NAME ...] [--epsilon EPS] [--no-zero-tail]
    otb-spec compute BATCH.npz [--estimator NAME] [--output OUT.npz]
    otb-spec lab [--quick] [--seed S] [--regime NAME ...] [--group-size N ...] [--plot PNG] [--json PATH]
    otb-spec verify TARGET --kind {otb,tir-otb,loo-otb,tir-loo-otb,sum-pi-squared,fused-token-statistics}
                    [--convention verl] [--device cpu|cuda] [--max-examples N] [--seed S] [--json PATH]
                    [--skip FILE] [--layer L ...] [--shrink-budget N] [--strict] [--timeout SECONDS] [--fail-fast]
                    [--no-progress] [--verbose] [--working-dtype DTYPE]
    otb-spec verify --adapter NAME [--kind K ...] [same options]
    otb-spec mutants [--max-examples N] [--seed S] [--markdown]
    otb-spec vectors --out DIR [--kind K ...] [--generated N] [--no-special] [--seed S]

Exit status: 0 on success (verify: conformant, documented deviations of verl included), 1 verify: not conformant (mutants: a mutant survived), 2 on usage,
import or input errors (with a one-line message on stderr).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

import numpy as np

from otb_spec._version import __version__
from otb_spec.estimators import ESTIMATORS, RolloutBatch
from otb_spec.examples import example_batch
from otb_spec.proxy import _energy
from otb_spec.trajectory import cumulative_energy, reward_to_go

__all__ = ["main", "build_parser"]

_KIND_DESCRIPTIONS = {
    "otb": "single-turn (self-inclusive) OTB, tokens aligned by position; optional rollout IS weights ρ (ρ² in the "
           "energy) — verl's compute_optimal_token_baseline_advantage",
    "tir-otb": "multi-turn OTB for tool-integrated reasoning: each member's valid tokens compacted and aligned by "
               "their rank, tool holes skipped; optional ρ — verl's "
               "compute_multi_turn_optimal_token_baseline_advantage",
    "loo-otb": "leave-one-out OTB (the unbiased variant: each member's baseline from the others), position alignment",
    "tir-loo-otb": "multi-turn leave-one-out OTB: the others' energies and returns at each member's k-th valid token "
                   "(align='valid_token'), tool holes skipped",
    "sum-pi-squared": "Σπ² = Σ_v softmax(z)_v² per row of logits; f(logits) in every convention — verl's "
                      "calculate_sum_pi_squared_from_logits",
    "fused-token-statistics": "log π(y), entropy (and Σπ² where returned) of softmax(h·Wᵀ/τ) from hidden states and "
                              "the LM head, values and gradients — verl's FusedLinearForPPO",
}
_KINDS = tuple(_KIND_DESCRIPTIONS)     # otb_spec.conformance.KINDS, in its order (a test checks)
_VECTOR_KINDS = tuple(kind for kind in _KINDS if kind != "fused-token-statistics")   # no fused vectors (vectors.md)
_BATCH_KEYS = ("rewards", "response_mask", "group_ids", "log_probs", "sum_pi_squared", "is_weights",
               "cumulative_score_sq_norms", "sequence_score_sq_norms")


def _seed(text: str) -> int:
    """A seed argument: a non-negative integer (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for documentation and tests)."""
    parser = argparse.ArgumentParser(
        prog="otb-spec",
        description="Reference specification of the Optimal Token Baseline (arXiv 2602.07078).",
    )
    parser.add_argument("--version", action="version", version=f"otb-spec {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = commands.add_parser("demo", help="compute OTB on a small example batch and print a per-token table")
    demo.add_argument("--estimator", action="append", choices=sorted(ESTIMATORS), metavar="NAME",
                      help="add an estimator's advantages as a column (repeatable; default: otb and otb_loo)")
    demo.add_argument("--epsilon", type=float, default=1e-8, help="ε in OTB's denominator (default 1e-8)")
    demo.add_argument("--no-zero-tail", action="store_true", help="handle_zero_tail=False for OTB")
    demo.set_defaults(run=_run_demo)

    compute = commands.add_parser("compute", help="compute advantages for a batch stored in an .npz file")
    compute.add_argument("batch", help=f".npz with arrays named {', '.join(_BATCH_KEYS)} (the first three required)")
    compute.add_argument("--estimator", default="otb", choices=sorted(ESTIMATORS), metavar="NAME",
                         help="estimator to apply (default: otb)")
    compute.add_argument("--output", help="write advantages, returns and baselines to this .npz")
    compute.set_defaults(run=_run_compute)

    lab = commands.add_parser("lab", help="Monte Carlo lab: bias and variance of every estimator vs group size")
    lab.add_argument("--quick", action="store_true", help="small samples and T = 60 for the long regime (seconds)")
    lab.add_argument("--seed", type=_seed, default=0, help="seed of every random draw (default 0)")
    lab.add_argument("--regime", action="append", choices=["random", "confidence", "long"],
                     help="run only these regimes (repeatable; default: all three)")
    lab.add_argument("--group-size", action="append", type=int, metavar="N",
                     help="group sizes (repeatable; default: 2 4 8 16 32)")
    lab.add_argument("--plot", default="lab-output/variance_vs_n.png",
                     help="PNG of variance vs N (default lab-output/variance_vs_n.png; '' to skip)")
    lab.add_argument("--json", help="also write every number, with standard errors, to this JSON file")
    lab.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    lab.set_defaults(run=_run_lab)

    verify = commands.add_parser(
        "verify", help="check an OTB implementation against the reference (exit 0 conformant, 1 not, 2 usage)",
        description="Layered conformance checks: signature, structure (shapes, dtypes, devices, inputs unchanged, "
                    "determinism), golden cases, Hypothesis-generated cases (shrunk on failure), special cases, "
                    "robustness (warnings only). The first line of the report is the verdict: CONFORMANT, CONFORMANT "
                    "WITH N DOCUMENTED DEVIATIONS (verl 0.9.1's own differences from the reference, listed; exit 0) "
                    "or NOT CONFORMANT (exit 1).")
    verify.add_argument("target", nargs="?", help="package.module:callable or path/to/file.py:callable")
    verify.add_argument("--kind", action="append", choices=list(_KINDS),
                        help="what the target computes (required with TARGET; with --adapter, repeatable, default "
                             "every kind the adapter has)")
    verify.add_argument("--adapter", metavar="NAME", help="check a registered adapter (otb_spec.adapters) instead")
    verify.add_argument("--convention", default="verl", help="calling convention (default verl; see --list)")
    verify.add_argument("--device", default="cpu", help="where inputs go: cpu or cuda (default cpu)")
    verify.add_argument("--max-examples", type=int, default=100, metavar="N",
                        help="Hypothesis examples per generated profile (default 100)")
    verify.add_argument("--seed", type=_seed, default=0, help="Hypothesis seed; the same seed replays (default 0)")
    verify.add_argument("--shrink-budget", type=int, default=None, metavar="N",
                        help="further runs spent shrinking a failing generated case (default 200; 0: none)")
    verify.add_argument("--layer", action="append", metavar="LAYER",
                        help="run only these layers (repeatable): signature, structure, golden, generated, special, "
                             "robustness")
    verify.add_argument("--skip", metavar="FILE",
                        help="skip checks: one check-id pattern per line, each with '# reason'")
    verify.add_argument("--strict", action="store_true",
                        help="count the documented deviations of verl 0.9.1 as failures")
    verify.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="time limit for one call of the target (default 120; 0: none); a call that does not "
                             "return fails its check and stops the run")
    verify.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    verify.add_argument("--fail-fast", action="store_true", help="stop at the first failing check")
    verify.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    verify.add_argument("--verbose", action="store_true", help="list passing checks too")
    verify.add_argument("--working-dtype", metavar="DTYPE", choices=["float64", "float32", "float16", "bfloat16"],
                        help="fused-token-statistics and sum-pi-squared: judge the target as working in at least "
                             "this precision (e.g. float32 for a kernel that widens bfloat16 inputs before its "
                             "matmul or its log-sum-exps; default: the inputs' dtype, as verl's FusedLinearForPPO and "
                             "calculate_sum_pi_squared_from_logits); the OTB kinds (float32 or float64): the "
                             "target computes in this precision whatever its inputs (.float(), .double(): more precise "
                             "inputs judged as rounded to it, less precise ones as widened to it; with --adapter: in "
                             "at least this precision, half-precision inputs held to its bound); default: as verl, "
                             "each input dtype in its own precision")
    verify.add_argument("--list", action="store_true", help="list conventions and kinds, then exit")
    verify.set_defaults(run=_run_verify)

    mutants = commands.add_parser("mutants", help="run the verifier over deliberately broken implementations "
                                                  "and print which checks catch each (needs torch)")
    mutants.add_argument("--max-examples", type=int, default=100, metavar="N",
                         help="Hypothesis examples per generated profile (default 100)")
    mutants.add_argument("--seed", type=_seed, default=0, help="Hypothesis seed (default 0)")
    mutants.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    mutants.set_defaults(run=_run_mutants)

    vectors = commands.add_parser("vectors", help="write golden vectors (JSON + .npz) for ports in any language")
    vectors.add_argument("--out", required=True, metavar="DIR", help="directory to write (created if needed)")
    vectors.add_argument("--kind", action="append", choices=list(_VECTOR_KINDS),
                         help="only these kinds (repeatable)")
    vectors.add_argument("--generated", type=int, default=10, metavar="N",
                         help="Hypothesis-generated cases per profile and kind (default 10)")
    vectors.add_argument("--no-special", action="store_true",
                         help="leave out the large special cases (T up to 16411, V up to 151937; about 175 MB)")
    vectors.add_argument("--seed", type=_seed, default=0, help="Hypothesis seed of the generated cases (default 0)")
    vectors.set_defaults(run=_run_vectors)

    experiment = commands.add_parser(
        "experiment", help="a reproducible RL run on CPU: OTB at N = 4 vs the group mean at N = 32, per token, and a "
                           "long-horizon stability set-up (needs torch and matplotlib; docs/experiment.md)")
    experiment.add_argument("--quick", action="store_true",
                            help="a pipeline check in seconds (1 seed, tiny set-ups, a few steps)")
    experiment.add_argument("--out", default="experiment-output", metavar="DIR",
                            help="results, runs, checkpoints and the report go here; an interrupted run resumes "
                                 "from it (default experiment-output)")
    experiment.add_argument("--setup", action="append", choices=["main", "long"],
                            help="set-ups (repeatable; default both: main, then long)")
    experiment.add_argument("--seed", type=_seed, action="append", metavar="S",
                            help="seeds (repeatable; default the set-up's pre-registered seeds)")
    experiment.add_argument("--arm", action="append", metavar="NAME",
                            help="arms (repeatable; default all: gm32 otb4 loo4 gm4 rloo4)")
    experiment.add_argument("--update", action="append", metavar="RULE", help="update rules: pg, ppo (default pg)")
    experiment.add_argument("--samples", type=int, metavar="N", help="N for the N = 4 arms (at least 2)")
    experiment.add_argument("--report-only", action="store_true",
                            help="train nothing: summarize the finished runs in DIR and rewrite the report and plot")
    experiment.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    experiment.set_defaults(run=_run_experiment)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``otb-spec`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return int(args.run(args))
    except (ValueError, TypeError, OSError, KeyError) as exc:
        print(f"otb-spec {args.command}: error: {exc}", file=sys.stderr)
        return 2


def _run_demo(args: argparse.Namespace) -> int:
    batch = example_batch()
    names = args.estimator or ["otb", "otb_loo"]
    options = {"epsilon": args.epsilon, "handle_zero_tail": not args.no_zero_tail}
    results = {}
    for name in names:
        estimator = ESTIMATORS[name]
        if not estimator.accepts(batch):
            raise ValueError(f"estimator {name!r} needs {', '.join(estimator.requires)}, which the example lacks")
        accepted = _accepted_options(name, options)
        results[name] = estimator(batch, **accepted)
    mask = np.asarray(batch.response_mask)
    energy = _energy(np.asarray(batch.log_probs), np.asarray(batch.sum_pi_squared))
    realized = cumulative_energy(energy, mask, None)
    returns = reward_to_go(np.asarray(batch.rewards), mask)
    otb = results.get("otb")
    print(f"otb-spec {__version__} — example batch: {batch.batch_size} trajectories × {batch.n_positions} positions, "
          f"2 prompts; ε = {args.epsilon:g}, handle_zero_tail = {not args.no_zero_tail}")
    print("π = exp(log π(y)), w = 1 − 2π + Σπ², W = Σ_{j≤t} m w, G = Σ_{k≥t} m r, B = OTB baseline, A = advantages")
    header = ["traj", "group", "t", "m", "r", "π", "Σπ²", "w", "W", "G"]
    if otb is not None:
        header.append("B(otb)")
    header += [f"A({name})" for name in names]
    rows = []
    for i in range(batch.batch_size):
        for t in range(batch.n_positions):
            if mask[i, t] == 0 and not _inside(mask[i], t):
                continue
            row = [str(i), str(batch.group_ids[i]), str(t), f"{mask[i, t]:.0f}", f"{batch.rewards[i, t]:g}",
                   f"{np.exp(batch.log_probs[i, t]):.3f}", f"{batch.sum_pi_squared[i, t]:.3f}",
                   f"{energy[i, t]:.3f}", f"{realized[i, t]:.3f}", f"{returns[i, t]:g}"]
            if otb is not None:
                row.append(f"{otb.baselines[i, t]:.4f}")
            row += [f"{results[name].advantages[i, t]:+.4f}" for name in names]
            rows.append(row)
    _print_table(header, rows)
    print("Rows with m = 0 inside a response are tool output; padding after the last token is not shown.")
    return 0


def _run_compute(args: argparse.Namespace) -> int:
    with np.load(args.batch, allow_pickle=True) as data:
        missing = [key for key in _BATCH_KEYS[:3] if key not in data]
        if missing:
            raise ValueError(f"{args.batch} lacks required array(s) {', '.join(missing)}")
        unknown = sorted(set(data.files) - set(_BATCH_KEYS))
        if unknown:
            raise ValueError(f"{args.batch}: unknown array(s) {', '.join(unknown)}; expected names among "
                             f"{', '.join(_BATCH_KEYS)}")
        batch = RolloutBatch(**{key: data[key] for key in data.files})
    result = ESTIMATORS[args.estimator](batch)
    if args.output:
        np.savez(args.output, advantages=result.advantages, returns=result.returns, baselines=result.baselines)
        print(f"wrote advantages, returns, baselines [{batch.batch_size}, {batch.n_positions}] to {args.output}")
    else:
        np.set_printoptions(precision=4, suppress=True, linewidth=120)
        print(f"advantages ({args.estimator}):")
        print(result.advantages)
    return 0


def _run_lab(args: argparse.Namespace) -> int:
    import json

    from otb_spec.lab import GROUP_SIZES, format_report, plot_variance, run_lab

    if args.json:
        _require_writable("--json", args.json)
    sizes = tuple(sorted(set(args.group_size))) if args.group_size else GROUP_SIZES
    if any(n < 1 for n in sizes):
        raise ValueError(f"--group-size: must be ≥ 1, got {sizes}")
    result = run_lab(quick=args.quick, seed=args.seed, group_sizes=sizes,
                     regime_names=tuple(args.regime) if args.regime else None,
                     progress=None if args.no_progress else sys.stderr)
    command = ("otb-spec lab" + (" --quick" if args.quick else "") + (f" --seed {args.seed}" if args.seed else "")
               + "".join(f" --regime {name}" for name in args.regime or ())
               + "".join(f" --group-size {n}" for n in args.group_size or ()))
    print(format_report(result, command))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result.to_json(), handle, indent=1)
        print(f"\nwrote {args.json}")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("\nno plot: matplotlib is not installed (pip install 'otb-spec[lab]')")
        else:
            directory = os.path.dirname(args.plot)
            if directory:
                os.makedirs(directory, exist_ok=True)
            plot_variance(result, args.plot)
            print(f"\nwrote {args.plot}")
    return 0


def _require_writable(option: str, path: str) -> None:
    """Refuse, before any work, an output path whose folder does not exist or cannot be written (exit 2)."""
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise ValueError(f"{option}: cannot write {path!r} (" + ("a folder" if os.path.isdir(path) else
                         f"no writable folder {folder!r}") + ")")


def _run_verify(args: argparse.Namespace) -> int:
    from otb_spec.conformance import (CONVENTIONS, DEFAULT_TIMEOUT, LAYERS, SHRINK_BUDGET, read_skip_file, verify,
                                      verify_adapter)

    if args.list:
        print("conventions (--convention):")
        for convention in CONVENTIONS.values():
            print(f"  {convention.name:<10} {convention.description}; kinds: {', '.join(convention.kinds)}")
        print("kinds (--kind):")
        for kind, description in _KIND_DESCRIPTIONS.items():
            print(f"  {kind:<23} {description}")
        print(f"layers (--layer): {', '.join(LAYERS)}")
        return 0
    if (args.target is None) == (args.adapter is None):
        raise ValueError("give either TARGET (package.module:callable or file.py:callable) or --adapter NAME")
    if args.target is not None and (not args.kind or len(args.kind) != 1):
        raise ValueError(f"--kind: give exactly one kind with TARGET ({', '.join(_KINDS)})")
    if args.max_examples < 1:
        raise ValueError(f"--max-examples: must be ≥ 1, got {args.max_examples}")
    if args.timeout is not None and not args.timeout >= 0:
        raise ValueError(f"--timeout: must be ≥ 0 seconds (0: no limit), got {args.timeout}")
    if args.json:
        _require_writable("--json", args.json)
    progress = None
    if not args.no_progress and sys.stderr.isatty():
        def progress(label: str) -> None:
            print(f"\r\033[Kverifying: {label}", end="", file=sys.stderr, flush=True)
    options = dict(max_examples=args.max_examples, seed=args.seed,
                   layers=tuple(args.layer) if args.layer else LAYERS,
                   skips=read_skip_file(args.skip) if args.skip else (),
                   shrink_budget=SHRINK_BUDGET if args.shrink_budget is None else args.shrink_budget,
                   strict=args.strict, timeout=DEFAULT_TIMEOUT if args.timeout is None else args.timeout,
                   progress=progress, fail_fast=args.fail_fast)
    if args.adapter is not None:
        report = verify_adapter(args.adapter, kinds=tuple(args.kind) if args.kind else None,
                                working_dtype=args.working_dtype, **options)
    else:
        report = verify(args.target, args.kind[0], convention=args.convention, device=args.device,
                        working_dtype=args.working_dtype, **options)
    if progress is not None:
        print("\r\033[K", end="", file=sys.stderr, flush=True)
    print(report.to_text(verbose=args.verbose))
    if args.json:
        report.write_json(args.json)
        print(f"wrote {args.json}")
    _exit_if_a_target_is_still_running(report.exit_status)
    return report.exit_status


def _exit_if_a_target_is_still_running(status: int) -> None:
    """A target that timed out still runs in its daemon thread; letting the interpreter finalise under it can abort
    the process from native code (torch: "terminate called without an active exception", exit 134). The report is
    out, so leave at once with the report's exit status."""
    import threading

    from otb_spec.conformance._checks import TARGET_THREAD

    if any(thread.name == TARGET_THREAD and thread.is_alive() for thread in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def _run_mutants(args: argparse.Namespace) -> int:
    from otb_spec.conformance.mutants import kill_table

    table = kill_table(max_examples=args.max_examples, seed=args.seed,
                       progress=sys.stderr if sys.stderr.isatty() else None)
    print(table.to_markdown() if args.markdown else table.to_text())
    return 0 if table.all_killed and table.controls_pass else 1


def _run_vectors(args: argparse.Namespace) -> int:
    from otb_spec.conformance.vectors import write_vectors

    manifest = write_vectors(args.out, kinds=tuple(args.kind) if args.kind else _VECTOR_KINDS, generated=args.generated,
                             special=not args.no_special, seed=args.seed)
    counts: dict[str, int] = {}
    for entry in manifest["cases"]:
        counts[entry["kind"]] = counts.get(entry["kind"], 0) + 1
    print(f"wrote {len(manifest['cases'])} cases ({', '.join(f'{k}: {n}' for k, n in counts.items())}) to "
          f"{args.out}: manifest.json, schema.json, <kind>/*.json and *.npz (format: docs/vectors.md)")
    return 0


def _run_experiment(args: argparse.Namespace) -> int:
    import dataclasses

    from otb_experiment import QUICK_SETUPS, SETUPS, run_all   # imported here: torch is needed only for this command

    setups = [config for config in (QUICK_SETUPS if args.quick else SETUPS)
              if args.setup is None or config.name in args.setup]
    changes = {name: tuple(value) for name, value in (("seeds", args.seed), ("arms", args.arm),
                                                     ("updates", args.update)) if value}
    if args.samples is not None:
        changes["samples_override"] = args.samples
    configs = [dataclasses.replace(config, **changes) for config in setups]
    if args.report_only and not os.path.isdir(args.out):
        raise ValueError(f"--out: no folder {args.out!r} to report on (--report-only reads an earlier run's results)")
    results = run_all(configs, args.out, progress=not args.no_progress, train=not args.report_only)
    for name, summary in results.items():
        for key, entry in summary["arms"].items():
            final, tokens = entry["final_accuracy"], entry["tokens"]
            print(f"{name:5s} {key:10s} final accuracy {final['mean']:.3f} ± {final['se']:.3f}   "
                  f"tokens {tokens['mean']:.0f}")
        for update, decision in summary["decision"].items():
            verdicts = ", ".join(f"{arm} {entry['verdict']}" for arm, entry in decision["arms"].items())
            print(f"{name} {update}: pre-registered claim: {decision['claim']} ({verdicts})")
    print(f"wrote {args.out}/report.md and {args.out}/accuracy_vs_tokens.png")
    return 0


def _accepted_options(name: str, options: dict) -> dict:
    if name in ("otb", "otb_multi_turn"):
        return options
    if name in ("otb_loo",):
        return {"epsilon": options["epsilon"]}
    return {}


def _inside(row: np.ndarray, t: int) -> bool:
    valid = np.flatnonzero(row)
    return valid.size > 0 and valid[0] < t < valid[-1]


def _print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(header[c]), *(len(row[c]) for row in rows)) for c in range(len(header))]
    print("  ".join(h.rjust(w) for h, w in zip(header, widths)))
    print("  ".join("─" * w for w in widths))
    previous = None
    for row in rows:
        if previous is not None and row[0] != previous:
            print()
        previous = row[0]
        print("  ".join(cell.rjust(w) for cell, w in zip(row, widths)))


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
