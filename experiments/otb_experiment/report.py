"""The report of `otb-spec experiment`, made mechanically from the results files: ``report.md`` (the decision under
the pre-registered rule, tables with standard errors, stability, gradient variance, proxy correlation, cost) and
``accuracy_vs_tokens.png`` (the curves). docs/experiment.md's outcome is this report, copied.

    otb-spec experiment --report-only --out DIR     # rewrite DIR/report.md and the plot from DIR/<setup>/runs
    python -m otb_experiment.report DIR docs         # copy it into docs/experiment.md's outcome, with the files
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["markdown", "plot", "readme_sentences", "publish", "main"]


def _pm(entry: dict, digits: int = 3) -> str:
    se = entry.get("se", float("nan"))
    if isinstance(se, float) and math.isnan(se):
        return f"{entry['mean']:.{digits}f}"
    return f"{entry['mean']:.{digits}f} ± {se:.{digits}f}"


def _over_seeds(values: list[float]) -> dict:
    se = float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else float("nan")
    return {"mean": float(np.mean(values)), "se": se}


def _fractions(values: list) -> str:
    return ", ".join("—" if v is None else f"{v:.2f}" for v in values)


def _median(values: list) -> str:
    present = [v for v in values if v is not None]
    return f"{float(np.median(present)):.1f}" if present else "—"


def _decision_lines(name: str, update: str, decision: dict) -> list[str]:
    lines = [f"**{name} / {update}: {decision['claim']}** (gm32 gained "
             + ("—" if decision["gm32_gain"] is None else f"{decision['gm32_gain']:+.3f}")
             + f" over the warm start; margin δ = {decision['margin']}, {100 * decision['confidence']:.0f} % "
               "t-intervals of the mean paired difference D = final accuracy − gm32's final accuracy over the seeds)",
             ""]
    for arm, entry in decision["arms"].items():
        d = entry["difference"]
        interval = "—" if math.isnan(d["low"]) else f"[{d['low']:+.3f}, {d['high']:+.3f}]"
        lines.append(f"* {arm}: D = {d['mean']:+.3f} ± {d['se']:.3f}, interval {interval} over {d['n']} seeds — "
                     f"**{entry['verdict']}**")
    if decision.get("secondary"):
        lines += ["", "Secondary (learning speed: mean held-out accuracy over a run's evaluations, paired by seed):",
                  ""]
        for pair, entry in decision["secondary"].items():
            d = entry["difference"]
            interval = "—" if math.isnan(d["low"]) else f"[{d['low']:+.3f}, {d['high']:+.3f}]"
            lines.append(f"* {pair}: {d['mean']:+.3f} ± {d['se']:.3f}, interval {interval} — {entry['verdict']}")
    return lines + [""]


def _arm_table(results: dict) -> list[str]:
    lines = ["| update / arm | start accuracy | final accuracy | gain | sampled accuracy (final) | tokens (mean) | "
             "tokens / gm32's | D vs gm32 (mean ± SE) | first reach of gm32's final (fraction of its tokens, per "
             "seed; — never) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, entry in results["arms"].items():
        fractions = entry["token_fraction_of_gm32"]
        difference = entry["difference_from_gm32"]
        d = "—" if key.endswith("/gm32") or not difference else _pm(
            {"mean": float(np.mean(difference)),
             "se": float(np.std(difference, ddof=1) / math.sqrt(len(difference))) if len(difference) > 1
             else float("nan")})
        lines.append(f"| {key} | {_pm(entry['start_accuracy'])} | {_pm(entry['final_accuracy'])} | "
                     f"{_pm(entry['gain'])} | {_pm(entry['final_sampled_accuracy'])} | "
                     f"{entry['tokens']['mean']:,.0f} | "
                     f"{np.mean(fractions):.3f} | {d} | {_fractions(entry['first_reach_fraction'])} |")
    return lines + [""]


def _stability_table(results: dict) -> list[str]:
    lines = ["| update / arm | runs with a gradient-norm spike | spikes (all runs) | median over runs of the largest "
             "‖g‖ / median of the earlier norms | final token entropy (nats) | entropy collapse | divergence |",
             "|---|---|---|---|---|---|---|"]
    for key, entry in results["arms"].items():
        runs = len(entry["seeds"])
        spiked = sum(1 for s in entry["spikes"] if s > 0)
        lines.append(f"| {key} | {spiked} of {runs} | {sum(entry['spikes'])} | {_median(entry['max_norm_ratio'])} | "
                     f"{_pm(entry['final_entropy'], 4)} | {entry['collapsed']} of {runs} | "
                     f"{entry['diverged']} of {runs} |")
    return lines + [""]


def _variance_table(results: dict) -> list[str]:
    reference = next((e for k, e in results["arms"].items() if k == "pg/gm32"), None)
    if reference is None or not reference["variance_start"]:
        return []

    def stat(samples: list[dict], arm: str, key: str) -> str:
        values = [s[arm][key] for s in samples if arm in s]
        if not values:
            return "—"
        se = float(np.std(values, ddof=1) / math.sqrt(len(values))) if len(values) > 1 else float("nan")
        return _pm({"mean": float(np.mean(values)), "se": se})

    arms = list(reference["variance_start"][0])
    lines = ["Gradient variance (pg; total variance tr Cov(ĝ) of one step's gradient, over independent batches; "
             "mean ± SE over seeds; ‖ḡ‖² is the squared norm of the mean of the resampled gradients, which includes "
             "tr Cov / resamples of noise):", "",
             "| arm | warm start: tr Cov | ‖ḡ‖² | gm32's final parameters: tr Cov | ‖ḡ‖² |", "|---|---|---|---|---|"]
    for arm in arms:
        lines.append(f"| {arm} | {stat(reference['variance_start'], arm, 'total_variance')} | "
                     f"{stat(reference['variance_start'], arm, 'mean_gradient_sq_norm')} | "
                     f"{stat(reference['variance_end'], arm, 'total_variance')} | "
                     f"{stat(reference['variance_end'], arm, 'mean_gradient_sq_norm')} |")
    lines.append("")
    for kind, label in (("token", "proxy wₜ vs exact ‖∇θ log π(yₜ)‖²"),
                        ("cumulative", "realized energy Wₜ vs exact ‖Sₜ‖²")):
        values = {m: [p[kind][m] for p in reference["proxy_start"]] for m in ("pearson", "spearman")}
        text = ", ".join(f"{m.capitalize()} {_pm(_over_seeds(v))}" for m, v in values.items())
        lines.append(f"* {label} (warm start, sampled responses): {text}.")
    return lines + [""]


def _warm_and_cost(results: dict) -> list[str]:
    any_entry = next(iter(results["arms"].values()), None)
    if any_entry is None:
        return []
    steps = [w["sft_steps"] for w in any_entry["warm_start"]]
    accuracy = [w["sft_validation_accuracy"] for w in any_entry["warm_start"]]
    seconds = sum(entry["seconds"] for entry in results["arms"].values())
    return [f"Warm starts: {min(steps)}–{max(steps)} supervised steps (validation accuracy "
            f"{min(accuracy):.3f}–{max(accuracy):.3f}). RL compute: {seconds / 3600:.2f} core-hours "
            f"(one torch thread per run).", ""]


def markdown(results_by_setup: dict[str, dict]) -> str:
    """The report of every set-up's results (``{"main": results, "long": results}``) as Markdown."""
    lines = ["# otb-spec experiment: report", "",
             "Generated by `otb_experiment.report` from the results files; the decision rule and the stability "
             "definitions are the pre-registered ones (docs/experiment.md).", ""]
    for name, results in results_by_setup.items():
        config = results["config"]
        lines += [f"## Set-up `{name}`: n ∈ [{config['min_digits']}, {config['max_digits']}] digits, "
                  f"{len(config['seeds'])} seeds, gm32 {config['reference_steps']} steps"
                  + ("" if results.get("complete", True) else " — **PARTIAL: not every run has finished**"), ""]
        for update, decision in results["decision"].items():
            lines += _decision_lines(name, update, decision)
        lines += _arm_table(results)
        lines += ["Stability (pre-registered definitions):", ""] + _stability_table(results)
        lines += _variance_table(results)
        lines += _warm_and_cost(results)
    return "\n".join(lines) + "\n"


def plot(results_by_setup: dict[str, dict], path: str) -> None:
    """Held-out greedy accuracy (top row) and sampled accuracy (middle row) vs tokens, mean ± SE over seeds per arm,
    and the median gradient norm over the seeds vs the fraction of the run (bottom row); one column per set-up and
    update rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(name, update) for name, results in results_by_setup.items()
              for update in sorted({key.split("/")[0] for key in results["arms"]})]
    columns = max(len(panels), 1)
    figure, axes = plt.subplots(3, columns, figsize=(6 * columns, 12), squeeze=False)
    for column, (name, update) in enumerate(panels):
        arms = {key.split("/")[1]: entry for key, entry in results_by_setup[name]["arms"].items()
                if key.startswith(update + "/")}
        for arm, entry in arms.items():
            curves = entry["curves"]
            length = min(len(c["tokens"]) for c in curves)
            tokens = np.mean([c["tokens"][:length] for c in curves], axis=0)
            for row, key in ((0, "accuracy"), (1, "sampled_accuracy")):
                values = np.array([c[key][:length] for c in curves])
                mean = values.mean(0)
                se = values.std(0, ddof=1) / math.sqrt(len(values)) if len(values) > 1 else np.zeros_like(mean)
                axes[row, column].plot(tokens, mean, label=arm)
                axes[row, column].fill_between(tokens, mean - se, mean + se, alpha=0.2)
            norms = [np.asarray(t["grad_norm"]) for t in entry["training"]]
            length = min(len(n) for n in norms)
            median = np.median(np.stack([n[:length] for n in norms]), axis=0)
            axes[2, column].plot(np.arange(1, length + 1) / length, median, label=arm, linewidth=0.8)
        for row, label in ((0, "held-out greedy exact-match accuracy"), (1, "held-out sampled exact-match accuracy")):
            axes[row, column].set_xlabel("response tokens consumed")
            axes[row, column].set_ylabel(label)
            axes[row, column].set_title(f"{name} / {update}: {label.split(' exact')[0]} (mean ± SE over seeds)")
            axes[row, column].legend()
        axes[2, column].set_xlabel("fraction of the run (steps)")
        axes[2, column].set_ylabel("‖∇θ loss‖₂ (median over seeds)")
        if any(line.get_ydata().max(initial=0) > 0 for line in axes[2, column].get_lines()):
            axes[2, column].set_yscale("log")
        axes[2, column].set_title(f"{name} / {update}: gradient norm per step")
        axes[2, column].legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)


def readme_sentences(results_by_setup: dict[str, dict]) -> str:
    """Two sentences for the README, made from the main set-up's decision and the stability counts (a draft: the
    outcome's author checks and may reword them, never the numbers)."""
    main = results_by_setup.get("main")
    if main is None or "pg" not in main["decision"]:
        return ""
    decision = main["decision"]["pg"]
    seeds = len(main["config"]["seeds"])
    parts = []
    for arm in ("otb4", "loo4", "gm4", "rloo4"):
        entry = decision["arms"].get(arm)
        if entry is not None:
            d = entry["difference"]
            parts.append(f"{arm} {entry['verdict']} ({d['mean']:+.3f} ± {d['se']:.3f})")
    first = (f"In the pre-registered run ({seeds} seeds), with 35 % of GM(32)'s tokens against its "
             f"{main['arms']['pg/gm32']['final_accuracy']['mean']:.3f} final held-out accuracy: "
             + ", ".join(parts) + f" — the claim is {decision['claim']}.")
    unstable = []
    for name, results in results_by_setup.items():
        for key, entry in results["arms"].items():
            runs = len(entry["seeds"])
            spiked = sum(1 for s in entry["spikes"] if s > 0)
            if spiked or entry["collapsed"] or entry["diverged"]:
                unstable.append(f"{name} {key.split('/')[1]}: spikes in {spiked}/{runs} runs, "
                                f"{entry['collapsed']} collapsed, {entry['diverged']} diverged")
    second = ("No arm of either set-up (responses of 8–32 and 96–160 tokens) had a gradient-norm spike, an entropy "
              "collapse or a divergence." if not unstable else
              "Stability (pre-registered definitions): " + "; ".join(unstable) + "; every other arm of both set-ups "
              "had none.")
    return first + " " + second


def publish(out_dir: str, docs_dir: str) -> None:
    """Copy a finished run's report into the docs: ``summary.json`` → ``experiment-results.json``, the plot →
    ``experiment-accuracy-vs-tokens.png``, and the report's set-up sections (headings one level down) into
    ``experiment.md`` between "## Outcome" and "## Running it", under a paragraph left for what the result means,
    with the README sentences drafted at its end."""
    import json
    import os
    import shutil

    shutil.copyfile(os.path.join(out_dir, "summary.json"), os.path.join(docs_dir, "experiment-results.json"))
    shutil.copyfile(os.path.join(out_dir, "accuracy_vs_tokens.png"),
                    os.path.join(docs_dir, "experiment-accuracy-vs-tokens.png"))
    with open(os.path.join(out_dir, "summary.json"), encoding="utf-8") as handle:
        results = json.load(handle)
    with open(os.path.join(out_dir, "report.md"), encoding="utf-8") as handle:
        report = handle.read()
    body = report[report.index("## Set-up"):].replace("\n## ", "\n### ")
    body = "#" + body if body.startswith("## ") else body
    partial = any(not r.get("complete", True) for r in results.values())
    section = ("## Outcome\n\n"
               + ("**PARTIAL: not every run has finished; nothing below is the outcome.**\n\n" if partial else "")
               + "What this means for a user choosing between OTB, leave-one-out OTB and the group mean: (to be "
                 "written from the tables below).\n\n"
               + body.rstrip() + "\n\nThe curves: [experiment-accuracy-vs-tokens.png]"
                 "(experiment-accuracy-vs-tokens.png); all numbers: [experiment-results.json](experiment-results.json)."
                 "\n\n"
               + "Draft README sentences (generated): " + readme_sentences(results) + "\n\n")
    path = os.path.join(docs_dir, "experiment.md")
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    start, end = text.index("## Outcome"), text.index("## Running it")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text[:start] + section + text[end:])


def main(argv: list[str] | None = None) -> int:
    """``python -m otb_experiment.report OUT DOCS``: :func:`publish` a finished run's report into the docs."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m otb_experiment.report", description=main.__doc__)
    parser.add_argument("out", help="the run's output directory (with report.md, summary.json and the plot)")
    parser.add_argument("docs", help="the docs directory (experiment.md is edited in place)")
    args = parser.parse_args(argv)
    publish(args.out, args.docs)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
