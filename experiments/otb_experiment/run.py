"""Training, measurement and the whole experiment: `otb-spec experiment` (docs/experiment.md).

One *run* is (set-up, update rule, arm, seed): from the seed's supervised warm start, RL on the task with
``prompts_per_step`` prompts per step and the arm's N samples each, evaluated on the held-out split at evenly spaced
steps. The reference arm gm32 runs ``reference_steps`` steps; every N = 4 arm runs until it has drawn
``token_fraction`` of gm32's samples (0.35 → 2.8× gm32's steps). Responses have exactly as many tokens as their
prompt has digits, so a sample costs the same in every arm and the fraction of samples is the fraction of tokens.
All arms of a seed see the same stream of training prompts (common random numbers). Arms differ only in N and in how
advantages are computed (all by otb_torch):

  gm32   group mean, N = 32 (GRPO without std normalisation)
  otb4   verl's OTB (self-inclusive, zero tail), N = 4
  loo4   leave-one-out OTB, N = 4
  gm4    group mean, N = 4
  rloo4  RLOO, N = 4

Update rules: ``pg`` — plain policy gradient, loss = −(1/B)·Σᵢ Σₜ Aₜⁱ log π(yₜⁱ), one Adam step per batch; ``ppo`` —
verl-like PPO clipping (ε = 0.2) with token-mean aggregation over two mini-batches per batch (the second off-policy).
Everything is deterministic on CPU for a fixed seed (one torch thread).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import numpy as np
import torch

import otb_torch
from otb_experiment import task
from otb_experiment.policy import (Policy, Rollouts, gradient_norm, greedy, sample, teacher_forced,
                                   token_log_probs, token_statistics)

__all__ = ["ARMS", "UPDATES", "Config", "MAIN", "LONG", "SETUPS", "QUICK_MAIN", "QUICK_LONG", "QUICK_SETUPS",
           "run_experiment", "run_all", "arm_advantages", "steps_of", "samples_of", "stability", "summarize",
           "decision"]

ARMS = {"gm32": ("group_mean", 32), "otb4": ("otb", 4), "loo4": ("leave_one_out", 4), "gm4": ("group_mean", 4),
        "rloo4": ("rloo", 4)}
UPDATES = ("pg", "ppo")
REFERENCE = "gm32"


@dataclass(frozen=True)
class Config:
    """Every knob of one set-up of the experiment (recorded in its results). The decision rule and the stability
    definitions are part of it: docs/experiment.md states them in words."""

    name: str = "main"
    seeds: tuple[int, ...] = tuple(range(16))
    arms: tuple[str, ...] = tuple(ARMS)
    updates: tuple[str, ...] = ("pg",)
    # task and policy
    min_digits: int = 8
    max_digits: int = 32
    hidden: int = 64
    # supervised warm start: Adam at sft_learning_rate on batches of sft_batch targets until the validation split's
    # accuracy (greedy, or of one temperature-1 sample per prompt: sft_measure) reaches sft_target_accuracy (checked
    # every sft_check_every steps) or sft_steps_max
    sft_measure: str = "greedy"
    sft_learning_rate: float = 3e-3
    sft_batch: int = 64
    sft_check_every: int = 10
    sft_steps_max: int = 3000
    sft_target_accuracy: float = 0.15
    validation_prompts: int = 1024
    test_prompts: int = 4096
    # RL
    prompts_per_step: int = 16
    reference_steps: int = 500
    token_fraction: float = 0.35
    learning_rate: float = 1e-3
    evaluations: int = 10
    checkpoint_every: int = 50
    # measurements
    variance_resamples: int = 16
    proxy_sequences: int = 12
    # the pre-registered decision rule (docs/experiment.md)
    margin: float = 0.02
    min_reference_gain: float = 0.20
    confidence: float = 0.95
    # the pre-registered stability definitions (docs/experiment.md)
    spike_factor: float = 10.0
    spike_window: int = 50
    collapse_entropy: float = 0.01
    collapse_accuracy: float = 0.5
    divergence_drop: float = 0.10
    samples_override: int | None = None          # N for every N = 4 arm (tests; N < 2 is rejected)


# The pre-registered set-ups (docs/experiment.md, "Pre-registration"): chosen by the pilot (otb_experiment.pilot).
MAIN = Config()
LONG = Config(name="long", seeds=tuple(range(5)), min_digits=96, max_digits=160, sft_measure="sampled",
              sft_target_accuracy=0.05, test_prompts=2048, reference_steps=150, evaluations=6, proxy_sequences=4,
              min_reference_gain=0.05)
SETUPS = (MAIN, LONG)
QUICK_MAIN = Config(name="main", seeds=(0,), min_digits=3, max_digits=6, sft_steps_max=60, sft_check_every=20,
                    sft_target_accuracy=0.3, validation_prompts=32, test_prompts=64, prompts_per_step=4,
                    reference_steps=5, evaluations=2, checkpoint_every=5, variance_resamples=3, proxy_sequences=2,
                    spike_window=3)
QUICK_LONG = Config(name="long", seeds=(0,), arms=("gm32", "otb4"), min_digits=12, max_digits=16, sft_steps_max=20,
                    sft_check_every=20, sft_target_accuracy=0.3, validation_prompts=16, test_prompts=32,
                    prompts_per_step=2, reference_steps=2, evaluations=1, checkpoint_every=5, variance_resamples=2,
                    proxy_sequences=1, spike_window=3)
QUICK_SETUPS = (QUICK_MAIN, QUICK_LONG)


def samples_of(config: Config, arm: str) -> int:
    """N of ``arm`` (``samples_override`` replaces the 4 of the N = 4 arms)."""
    samples = ARMS[arm][1]
    return samples if (samples != 4 or config.samples_override is None) else config.samples_override


def steps_of(config: Config, arm: str) -> int:
    """gm32 runs ``reference_steps``; another arm runs until it has drawn ``token_fraction`` of gm32's samples."""
    if arm == REFERENCE:
        return config.reference_steps
    return max(1, round(config.reference_steps * ARMS[REFERENCE][1] * config.token_fraction / samples_of(config, arm)))


def _evaluation_steps(config: Config, arm: str) -> list[int]:
    steps = steps_of(config, arm)
    return sorted({max(1, round(k * steps / config.evaluations)) for k in range(1, config.evaluations + 1)})


def arm_advantages(arm: str, rewards: torch.Tensor, mask: torch.Tensor, ids: np.ndarray, log_probs: torch.Tensor,
                   sum_pi_squared: torch.Tensor) -> torch.Tensor:
    """[B, L] advantages of ``arm`` for terminal ``rewards`` [B, L] (the reward on the last valid token)."""
    kind = ARMS[arm][0]
    if kind == "otb":
        return otb_torch.optimal_token_baseline(rewards, mask, ids, log_probs, sum_pi_squared).advantages
    if kind == "leave_one_out":
        return otb_torch.leave_one_out_token_baseline(rewards, mask, ids, log_probs, sum_pi_squared).advantages
    if kind == "rloo":
        return otb_torch.rloo_advantage(rewards, mask, ids).advantages
    return otb_torch.group_mean_advantage(rewards, mask, ids).advantages


def _terminal_rewards(values: np.ndarray, mask: torch.Tensor) -> torch.Tensor:
    rewards = torch.zeros_like(mask)
    last = mask.sum(-1).to(torch.int64) - 1
    rewards[torch.arange(mask.shape[0]), last] = torch.from_numpy(values).to(mask.dtype)
    return rewards


def _prompts_at(pool: task.Prompts, rows: np.ndarray) -> task.Prompts:
    return task.Prompts(pool.digits[rows], pool.lengths[rows])


def _training_prompts(config: Config, rng: np.random.Generator) -> task.Prompts:
    return task.make_prompts(rng, config.prompts_per_step, config.min_digits, config.max_digits)


def greedy_accuracy(policy: Policy, prompts: task.Prompts) -> float:
    """Exact-match accuracy of greedy decoding (the held-out measure)."""
    return float(task.rewards_of(prompts, greedy(policy, prompts)).mean())


def sampled_accuracy(policy: Policy, prompts: task.Prompts, seed: int) -> float:
    """Exact-match accuracy of one temperature-1 sample per prompt (the RL objective), from a fixed generator."""
    rollouts = sample(policy, prompts, 1, torch.Generator().manual_seed(seed))
    return float(task.rewards_of(prompts, rollouts.tokens.numpy()).mean())


def splits(config: Config, seed: int) -> tuple[task.Prompts, task.Prompts]:
    """The seed's validation split (the warm start's stopping rule) and held-out test split (every accuracy)."""
    rng = np.random.default_rng([seed, 1])
    return (task.make_prompts(rng, config.validation_prompts, config.min_digits, config.max_digits),
            task.make_prompts(rng, config.test_prompts, config.min_digits, config.max_digits))


def _new_policy(config: Config) -> Policy:
    return Policy(hidden=config.hidden)


def warm_start(config: Config, seed: int, validation: task.Prompts,
               report: Callable[[str], None] | None = None) -> tuple[dict, dict]:
    """Supervised fine-tuning on targets until the validation split's accuracy (``sft_measure``: greedy, or one
    temperature-1 sample per prompt from a fixed generator) reaches ``sft_target_accuracy`` (checked every
    ``sft_check_every`` steps) or ``sft_steps_max``; returns (state dict, summary)."""
    torch.manual_seed(seed)
    policy = _new_policy(config)
    optimizer = torch.optim.Adam(policy.parameters(), lr=config.sft_learning_rate)
    rng = np.random.default_rng([seed, 2])

    def measure() -> float:
        if config.sft_measure == "sampled":
            return sampled_accuracy(policy, validation, 20_000 + seed)
        return greedy_accuracy(policy, validation)

    reached, step = measure(), 0
    while step < config.sft_steps_max and reached < config.sft_target_accuracy:
        prompts = task.make_prompts(rng, config.sft_batch, config.min_digits, config.max_digits)
        answers = torch.from_numpy(task.targets(prompts))
        mask = torch.from_numpy(task.response_mask(prompts.lengths, answers.shape[1])).to(torch.float32)
        rollouts = Rollouts(answers, mask, prompts.lengths, np.arange(config.sft_batch))
        logits = teacher_forced(policy, prompts, rollouts)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, task.OUTPUTS), answers.reshape(-1),
                                                 reduction="none")
        loss = (loss * mask.reshape(-1)).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % config.sft_check_every == 0:
            reached = measure()
            if report is not None:
                report(f"{config.name} warm start seed {seed}: step {step}, accuracy {reached:.2f}")
    return policy.state_dict(), {"sft_steps": step, "sft_validation_accuracy": reached,
                                 "sft_measure": config.sft_measure}


def _policy_loss(update: str, policy: Policy, prompts: task.Prompts, rollouts: Rollouts, advantages: torch.Tensor,
                 old_log_probs: torch.Tensor | None) -> torch.Tensor:
    log_probs = token_log_probs(teacher_forced(policy, prompts, rollouts), rollouts.tokens)
    mask = rollouts.mask
    if update == "pg":
        return -(advantages * log_probs * mask).sum() / mask.shape[0]
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _subset(rollouts: Rollouts, rows: np.ndarray) -> Rollouts:
    index = torch.from_numpy(rows)
    return Rollouts(rollouts.tokens[index], rollouts.mask[index], rollouts.lengths[rows], rollouts.prompt_rows[rows])


def _rollout_advantages(arm: str, policy: Policy, prompts: task.Prompts, samples: int,
                        generator: torch.Generator) -> tuple[Rollouts, np.ndarray, Any, torch.Tensor]:
    """Sample N responses per prompt, score them, and compute the arm's advantages from the model's own token
    statistics (masked positions get log π = 0, Σπ² = 1). Returns (rollouts, rewards [B], statistics, advantages)."""
    rollouts = sample(policy, prompts, samples, generator)
    rewards_np = task.rewards_of(_prompts_at(prompts, rollouts.prompt_rows), rollouts.tokens.numpy())
    with torch.no_grad():
        stats = token_statistics(teacher_forced(policy, prompts, rollouts), rollouts.tokens)
    mask = rollouts.mask
    advantages = arm_advantages(arm, _terminal_rewards(rewards_np, mask), mask, rollouts.prompt_rows,
                                stats.log_probs * mask, stats.sum_pi_squared * mask + (1 - mask))
    return rollouts, rewards_np, stats, advantages


def train_step(update: str, arm: str, policy: Policy, optimizer: torch.optim.Optimizer, prompts: task.Prompts,
               samples: int, generator: torch.Generator) -> dict:
    """One RL step; returns its statistics: tokens consumed, mean reward, mean token entropy, loss and the gradient
    norm ‖∇θ loss‖₂ before the optimiser step (for ppo the larger of its two mini-batches'). A non-finite loss or
    gradient is not applied: the statistics then say ``finite: False``."""
    rollouts, rewards_np, stats, advantages = _rollout_advantages(arm, policy, prompts, samples, generator)
    mask = rollouts.mask
    losses, norms = [], []
    if update == "pg":
        batches = [(rollouts, advantages, None)]
    else:
        old = stats.log_probs.detach()
        halves = np.array_split(np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=generator)))
                                .permutation(len(rewards_np)), 2)
        batches = [(_subset(rollouts, rows), advantages[torch.from_numpy(rows)], old[torch.from_numpy(rows)])
                   for rows in halves]
    finite = True
    for part, part_advantages, part_old in batches:
        loss = _policy_loss(update, policy, prompts, part, part_advantages, part_old)
        optimizer.zero_grad()
        loss.backward()
        norm = gradient_norm(policy)
        losses.append(float(loss.detach()))
        norms.append(norm)
        if not (math.isfinite(losses[-1]) and math.isfinite(norm)):
            finite = False
            break
        optimizer.step()
    entropy = float((stats.entropy * mask).sum() / mask.sum())
    return {"tokens": int(mask.sum()), "reward": float(rewards_np.mean()), "entropy": entropy,
            "loss": float(np.mean(losses)), "grad_norm": float(max(norms)), "finite": finite}


def gradient_variance(policy: Policy, config: Config, seed: int) -> dict:
    """Per arm, at the current parameters: the total variance tr Cov(ĝ) of the pg gradient estimate from
    ``prompts_per_step`` fresh prompts, over ``variance_resamples`` independent batches, with its standard error
    (from the spread of the squared deviations), and ‖mean ĝ‖²."""
    out = {}
    for arm in config.arms:
        rng = np.random.default_rng([seed, 3])
        generator = torch.Generator().manual_seed(seed * 1000 + 7)
        grads = []
        for _ in range(config.variance_resamples):
            prompts = _training_prompts(config, rng)
            rollouts, _, _, advantages = _rollout_advantages(arm, policy, prompts, samples_of(config, arm), generator)
            policy.zero_grad()
            _policy_loss("pg", policy, prompts, rollouts, advantages, None).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in policy.parameters()]).numpy().astype(np.float64))
        g = np.stack(grads)
        deviations = np.square(g - g.mean(0)).sum(1) * len(g) / (len(g) - 1)
        out[arm] = {"total_variance": float(deviations.mean()),
                    "total_variance_se": float(deviations.std(ddof=1) / math.sqrt(len(g))),
                    "mean_gradient_sq_norm": float(np.square(g.mean(0)).sum())}
    policy.zero_grad()
    return out


def proxy_correlation(policy: Policy, config: Config, seed: int) -> dict:
    """On sampled responses: the proxy wₜ = 1 − 2π + Σπ² against the exact ‖∇θ log π(yₜ)‖², and the realized energy
    Wₜ against the exact ‖Sₜ‖² = ‖∇θ Σ_{j≤t} log π(yⱼ)‖² (Pearson and Spearman correlations)."""
    rng = np.random.default_rng([seed, 4])
    prompts = task.make_prompts(rng, config.proxy_sequences, config.min_digits, config.max_digits)
    rollouts = sample(policy, prompts, 1, torch.Generator().manual_seed(seed))
    parameters = list(policy.parameters())
    proxy, exact, energy, cumulative = [], [], [], []
    for row in range(len(prompts.lengths)):
        single = _prompts_at(prompts, np.array([row]))
        one = _subset(rollouts, np.array([row]))._replace(prompt_rows=np.array([0]))
        logits = teacher_forced(policy, single, one)[0]
        length = int(one.lengths[0])
        log_probs = token_log_probs(logits, one.tokens[0])
        with torch.no_grad():
            pi = log_probs.exp()
            w = 1 - 2 * pi + torch.softmax(logits, -1).square().sum(-1)
        running = 0.0
        prefix = None
        for t in range(length):
            grads = torch.autograd.grad(log_probs[t], parameters, retain_graph=True)
            flat = torch.cat([g.reshape(-1) for g in grads]).double()
            prefix = flat if prefix is None else prefix + flat
            running += float(w[t])
            proxy.append(float(w[t]))
            exact.append(float(flat.square().sum()))
            energy.append(running)
            cumulative.append(float(prefix.square().sum()))

    def correlations(a: list[float], b: list[float]) -> dict:
        x, y = np.asarray(a), np.asarray(b)
        rank = lambda v: np.argsort(np.argsort(v)).astype(float)   # noqa: E731 - ties are rare in floats
        pearson = float(np.corrcoef(x, y)[0, 1]) if x.std() > 0 and y.std() > 0 else float("nan")
        spearman = float(np.corrcoef(rank(x), rank(y))[0, 1]) if len(x) > 1 and x.std() > 0 and y.std() > 0 \
            else float("nan")
        return {"pearson": pearson, "spearman": spearman, "tokens": len(x)}

    return {"token": correlations(proxy, exact), "cumulative": correlations(energy, cumulative)}


def _write_json(path: str, payload: Any) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1, sort_keys=True)
    os.replace(temporary, path)


class _Progress:
    """One line on stderr: completed work units, the current run, and an ETA from the rate so far."""

    def __init__(self, total_units: int, done_units: int = 0, stream: Any = None):
        self.total, self.done, self.start = total_units, done_units, time.monotonic()
        self.started_from = done_units
        self.stream = stream if stream is not None else sys.stderr
        self.line_mode = not self.stream.isatty()
        self.last_line = 0.0

    def note(self, label: str) -> None:
        """Redraw with a new label (work that the ETA does not count, such as a warm start)."""
        self.advance(0, label)

    def advance(self, units: int, label: str) -> None:
        self.done += units
        elapsed = time.monotonic() - self.start
        rate = (self.done - self.started_from) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        filled = int(30 * self.done / max(self.total, 1))
        eta_text = "?" if math.isinf(eta) else f"{int(eta // 3600)}h{int(eta % 3600 // 60):02d}m"
        text = (f"[{'#' * filled}{'.' * (30 - filled)}] {100 * self.done / max(self.total, 1):5.1f}% "
                f"{label:<44s} ETA {eta_text}")
        if self.line_mode:                            # a log file: one line a minute, and every label change
            now = time.monotonic()
            if units == 0 or now - self.last_line >= 60:
                self.stream.write(time.strftime("%H:%M:%S ") + text + "\n")
                self.last_line = now
        else:
            self.stream.write("\r" + text + "   ")
        self.stream.flush()


def check_config(config: Config, out_dir: str) -> None:
    """Reject bad knobs by name, and an output directory that cannot be written."""
    unknown = [arm for arm in config.arms if arm not in ARMS]
    if unknown:
        raise ValueError(f"arms: unknown arm {unknown[0]!r}; choose from {sorted(ARMS)}")
    if REFERENCE not in config.arms:
        raise ValueError(f"arms: the reference arm {REFERENCE!r} is needed (every comparison is against it)")
    bad = [update for update in config.updates if update not in UPDATES]
    if bad:
        raise ValueError(f"updates: unknown update rule {bad[0]!r}; choose from {list(UPDATES)}")
    if config.samples_override is not None and config.samples_override < 2:
        raise ValueError(f"samples: N must be at least 2 (a group needs another member), got {config.samples_override}")
    if not config.seeds:
        raise ValueError("seeds: need at least one seed")
    if config.sft_measure not in ("greedy", "sampled"):
        raise ValueError(f"sft_measure: 'greedy' or 'sampled', got {config.sft_measure!r}")
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, ".write-test")
        with open(probe, "w", encoding="utf-8") as handle:
            handle.write("")
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"out: cannot write the output directory {out_dir!r} ({exc.strerror or exc})") from exc


def plan_of(config: Config) -> list[tuple[str, str, int]]:
    """Every (update, arm, seed) of a set-up, in the order they run (seed by seed, gm32 first)."""
    return [(update, arm, seed) for seed in config.seeds for update in config.updates for arm in config.arms]


def work_of(config: Config, arm: str) -> int:
    """A run's cost in sampled tokens' units (steps × N × mean length), for the progress bar and the ETA."""
    return steps_of(config, arm) * samples_of(config, arm) * (config.min_digits + config.max_digits) // 2


def run_experiment(config: Config, out_dir: str, *, progress: bool | _Progress = True) -> dict:
    """Run (or resume) every (update, arm, seed) of one set-up, then write ``results.json``.

    Finished runs are stored as ``runs/<update>-<arm>-seed<s>.json`` and never redone; an unfinished run resumes from
    its last checkpoint in ``checkpoints/``. Returns the results dictionary.
    """
    check_config(config, out_dir)
    torch.set_num_threads(1)
    runs_dir, checkpoints = os.path.join(out_dir, "runs"), os.path.join(out_dir, "checkpoints")
    os.makedirs(runs_dir, exist_ok=True)
    os.makedirs(checkpoints, exist_ok=True)
    plan = plan_of(config)
    if isinstance(progress, _Progress):
        bar: _Progress | None = progress
    elif progress:
        total = sum(work_of(config, arm) for _, arm, _ in plan)
        done = sum(work_of(config, arm) for update, arm, seed in plan
                   if os.path.exists(os.path.join(runs_dir, f"{update}-{arm}-seed{seed}.json")))
        bar = _Progress(total, done)
    else:
        bar = None
    warm: dict[int, tuple[dict, dict]] = {}
    for update, arm, seed in plan:
        path = os.path.join(runs_dir, f"{update}-{arm}-seed{seed}.json")
        if os.path.exists(path):
            continue
        validation, test = splits(config, seed)
        if seed not in warm:
            warm_path = os.path.join(checkpoints, f"warm-seed{seed}.pt")
            if os.path.exists(warm_path):
                warm[seed] = torch.load(warm_path, weights_only=False)
            else:
                warm[seed] = warm_start(config, seed, validation, None if bar is None else bar.note)
                torch.save(warm[seed], warm_path)
        result = _one_run(config, update, arm, seed, test, warm[seed], checkpoints, bar)
        _write_json(path, result)
    results = summarize(config, runs_dir)
    _write_json(os.path.join(out_dir, "results.json"), results)
    return results


def _one_run(config: Config, update: str, arm: str, seed: int, test: task.Prompts, warm: tuple[dict, dict],
             checkpoints: str, bar: _Progress | None) -> dict:
    checkpoint = os.path.join(checkpoints, f"{update}-{arm}-seed{seed}.pt")
    policy = _new_policy(config)
    policy.load_state_dict(warm[0])
    optimizer = torch.optim.Adam(policy.parameters(), lr=config.learning_rate)
    generator = torch.Generator().manual_seed(seed * 7919 + list(ARMS).index(arm) * 31 + UPDATES.index(update))
    rng = np.random.default_rng([seed, 5])                 # the same prompt stream in every arm of the seed
    evaluation_seed = 10_000 + seed                         # the same sampled-accuracy draws at every evaluation
    samples, steps, unit = samples_of(config, arm), steps_of(config, arm), work_of(config, arm) / steps_of(config, arm)
    schedule = set(_evaluation_steps(config, arm))
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint, weights_only=False)
        policy.load_state_dict(saved["policy"])
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        rng.bit_generator.state = saved["rng"]
        history, start, tokens, extra, elapsed = (saved["history"], saved["step"], saved["tokens"], saved["extra"],
                                                  saved["elapsed"])
    else:
        history = {"step": [0], "tokens": [0], "accuracy": [greedy_accuracy(policy, test)],
                   "sampled_accuracy": [sampled_accuracy(policy, test, evaluation_seed)],
                   "reward": [], "entropy": [], "loss": [], "grad_norm": []}
        start, tokens, extra, elapsed = 0, 0, {}, 0.0
        if update == "pg" and arm == REFERENCE:
            extra["variance_start"] = gradient_variance(policy, config, seed)
            extra["proxy_start"] = proxy_correlation(policy, config, seed)
    began = time.monotonic()
    diverged_numerically = False
    for step in range(start, steps):
        prompts = _training_prompts(config, rng)
        stats = train_step(update, arm, policy, optimizer, prompts, samples, generator)
        tokens += stats["tokens"]
        for key in ("reward", "entropy", "loss", "grad_norm"):
            history[key].append(stats[key])
        if not stats["finite"]:
            diverged_numerically = True
            break
        if step + 1 in schedule:
            history["step"].append(step + 1)
            history["tokens"].append(tokens)
            history["accuracy"].append(greedy_accuracy(policy, test))
            history["sampled_accuracy"].append(sampled_accuracy(policy, test, evaluation_seed))
        if bar is not None:
            bar.advance(round(unit), f"{config.name} {update} {arm} seed {seed} step {step + 1}/{steps}")
        if (step + 1) % config.checkpoint_every == 0 and step + 1 < steps:
            torch.save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(),
                        "generator": generator.get_state(), "rng": rng.bit_generator.state, "history": history,
                        "step": step + 1, "tokens": tokens, "extra": extra,
                        "elapsed": elapsed + time.monotonic() - began}, checkpoint)
    if diverged_numerically and bar is not None:
        bar.advance(round(unit * (steps - len(history["reward"]))), f"{config.name} {update} {arm} seed {seed} "
                                                                      "diverged")
    if update == "pg" and arm == REFERENCE and not diverged_numerically:
        extra["variance_end"] = gradient_variance(policy, config, seed)
    if os.path.exists(checkpoint):
        os.remove(checkpoint)
    record = {"setup": config.name, "update": update, "arm": arm, "seed": seed, "samples": samples, "steps": steps,
              "history": history, "diverged_numerically": diverged_numerically, "warm_start": warm[1],
              "seconds": elapsed + time.monotonic() - began, "threads": torch.get_num_threads(), **extra}
    record["stability"] = stability(record, config)
    return record


def stability(record: dict, config: Config) -> dict:
    """The pre-registered stability measures of one run (docs/experiment.md), w = ``spike_window``:

    * gradient-norm spike: a step t > w whose gradient norm exceeds ``spike_factor`` × the median of all earlier
      steps' norms (the run's typical scale so far; a running window would call every failed batch of a nearly
      converged run a spike, since most of its groups then have zero advantage);
    * entropy collapse: the mean token entropy of the last w steps' samples is below ``collapse_entropy`` nats
      while the final held-out accuracy is below ``collapse_accuracy`` (confidently wrong, not converged);
    * divergence: a non-finite loss or gradient, or a final held-out accuracy more than ``divergence_drop`` below the
      warm start's.
    """
    norms = np.asarray(record["history"]["grad_norm"], dtype=float)
    ratios = _norm_ratios(norms, config.spike_window)
    spikes = [t for t, ratio in ratios if ratio > config.spike_factor]
    entropy = record["history"]["entropy"][-config.spike_window:]
    accuracy = record["history"]["accuracy"]
    final_entropy = float(np.mean(entropy)) if entropy else float("nan")
    collapsed = bool(entropy and final_entropy < config.collapse_entropy and accuracy[-1] < config.collapse_accuracy)
    diverged = bool(record["diverged_numerically"] or accuracy[-1] < accuracy[0] - config.divergence_drop)
    return {"spike_steps": spikes, "spikes": len(spikes),
            "max_norm_ratio": max((ratio for _, ratio in ratios), default=None),
            "final_entropy": final_entropy, "collapsed": collapsed, "diverged": diverged}


def _norm_ratios(norms: np.ndarray, window: int) -> list[tuple[int, float]]:
    """(t, ‖g_t‖ / median(‖g_0‖ … ‖g_{t−1}‖)) for every step t ≥ w with a positive finite median (t from 0)."""
    out = []
    for t in range(window, len(norms)):
        median = float(np.median(norms[:t]))
        if median > 0 and math.isfinite(median) and math.isfinite(norms[t]):
            out.append((t, float(norms[t] / median)))
    return out


def _mean_se(values: list[float]) -> dict:
    array = np.asarray(values, dtype=float)
    se = float(array.std(ddof=1) / math.sqrt(len(array))) if len(array) > 1 else float("nan")
    return {"mean": float(array.mean()), "se": se, "n": len(array)}


def summarize(config: Config, runs_dir: str) -> dict:
    """Collect the finished runs into per-(update, arm) summaries — start and final held-out accuracy, tokens,
    the paired difference from gm32 of the same seed, stability — and the pre-registered decision."""
    runs = {}
    for name in sorted(os.listdir(runs_dir)):
        if name.endswith(".json"):
            with open(os.path.join(runs_dir, name), encoding="utf-8") as handle:
                record = json.load(handle)
            record["stability"] = stability(record, config)     # the definitions of the config, applied afresh
            runs[(record["update"], record["arm"], record["seed"])] = record
    summary: dict = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
                     "arms": {}, "decision": {}, "complete": True}
    for update in config.updates:
        for arm in config.arms:
            records = [runs[(update, arm, seed)] for seed in config.seeds if (update, arm, seed) in runs]
            if len(records) < len(config.seeds):
                summary["complete"] = False
            if not records:
                continue
            paired = [(r, runs[(update, REFERENCE, r["seed"])]) for r in records
                      if (update, REFERENCE, r["seed"]) in runs]
            summary["arms"][f"{update}/{arm}"] = {
                "seeds": [r["seed"] for r in records],
                "start_accuracy": _mean_se([r["history"]["accuracy"][0] for r in records]),
                "final_accuracy": _mean_se([r["history"]["accuracy"][-1] for r in records]),
                "final_accuracy_per_seed": [r["history"]["accuracy"][-1] for r in records],
                "gain": _mean_se([r["history"]["accuracy"][-1] - r["history"]["accuracy"][0] for r in records]),
                "final_sampled_accuracy": _mean_se([r["history"]["sampled_accuracy"][-1] for r in records]),
                "tokens": _mean_se([r["history"]["tokens"][-1] for r in records]),
                "token_fraction_of_gm32": [r["history"]["tokens"][-1] / g["history"]["tokens"][-1]
                                           for r, g in paired if g["history"]["tokens"][-1]],
                "difference_from_gm32": [r["history"]["accuracy"][-1] - g["history"]["accuracy"][-1]
                                         for r, g in paired],
                "first_reach_fraction": [_tokens_to_reach(r, g) for r, g in paired],
                "mean_accuracy_over_run": [float(np.mean(r["history"]["accuracy"][1:])) for r in records],
                "spikes": [r["stability"]["spikes"] for r in records],
                "max_norm_ratio": [r["stability"]["max_norm_ratio"] for r in records],
                "final_entropy": _mean_se([r["stability"]["final_entropy"] for r in records]),
                "collapsed": sum(r["stability"]["collapsed"] for r in records),
                "diverged": sum(r["stability"]["diverged"] for r in records),
                "warm_start": [r["warm_start"] for r in records],
                "variance_start": [r["variance_start"] for r in records if r.get("variance_start")],
                "variance_end": [r["variance_end"] for r in records if r.get("variance_end")],
                "proxy_start": [r["proxy_start"] for r in records if r.get("proxy_start")],
                "seconds": sum(r["seconds"] for r in records),
                "curves": [{"tokens": r["history"]["tokens"], "accuracy": r["history"]["accuracy"],
                            "sampled_accuracy": r["history"]["sampled_accuracy"]} for r in records],
                "training": [{"reward": r["history"]["reward"], "entropy": r["history"]["entropy"],
                              "grad_norm": r["history"]["grad_norm"]} for r in records],
            }
        summary["decision"][update] = decision(summary["arms"], update, config)
    return summary


def _compact(results: dict) -> dict:
    """The results without the per-step training series (for docs/experiment-results.json; the curves stay)."""
    return {**results, "arms": {key: {k: v for k, v in entry.items() if k != "training"}
                                for key, entry in results["arms"].items()}}


def _tokens_to_reach(record: dict, reference: dict) -> float | None:
    """Tokens this run needed to first reach the reference (gm32) run's final accuracy, as a fraction of the
    reference's tokens; None when it never did (secondary: the decision uses the accuracy at the budget)."""
    target, budget = reference["history"]["accuracy"][-1], reference["history"]["tokens"][-1]
    for tokens, value in zip(record["history"]["tokens"], record["history"]["accuracy"]):
        if value >= target:
            return tokens / budget if budget else None
    return None


def _interval(values: list[float], confidence: float) -> dict:
    """Mean, standard error and the two-sided Student-t confidence interval of the mean."""
    from scipy import stats

    array = np.asarray(values, dtype=float)
    n = len(array)
    mean = float(array.mean()) if n else float("nan")
    if n < 2:
        return {"mean": mean, "se": float("nan"), "low": float("nan"), "high": float("nan"), "n": n}
    se = float(array.std(ddof=1) / math.sqrt(n))
    half = float(stats.t.ppf(0.5 + confidence / 2, n - 1)) * se
    return {"mean": mean, "se": se, "low": mean - half, "high": mean + half, "n": n}


def decision(arms: dict, update: str, config: Config) -> dict:
    """The pre-registered rule (docs/experiment.md), for one update rule.

    For each N = 4 arm a and seed s, D_{a,s} = final held-out accuracy of a (after ``token_fraction`` of gm32's
    tokens) − final held-out accuracy of gm32 (seed s). With the two-sided ``confidence`` t-interval [lo, hi] of the
    mean of D_a over the seeds and the margin δ: a *matches* gm32 if lo ≥ −δ, *falls short* if hi < −δ, and is
    *undecided* otherwise. The claim — OTB(4) trains as well as GM(32) with ``token_fraction`` of its tokens, and the
    token baseline is what makes it so — is *supported* if otb4 matches while gm4 and rloo4 both fall short; *not
    supported* if otb4 falls short or gm4 or rloo4 matches; otherwise *undecided*. It is *void* if gm32's mean gain
    over the warm start is below ``min_reference_gain`` (GM(32) did not learn enough for the comparison to mean
    anything) or a seed is missing.
    """
    reference = arms.get(f"{update}/{REFERENCE}")
    out: dict = {"margin": config.margin, "confidence": config.confidence, "arms": {}}
    for arm in ("otb4", "loo4", "gm4", "rloo4"):
        entry = arms.get(f"{update}/{arm}")
        if entry is None:
            continue
        interval = _interval(entry["difference_from_gm32"], config.confidence)
        if interval["n"] >= 2 and interval["low"] >= -config.margin:
            verdict = "matches"
        elif interval["n"] >= 2 and interval["high"] < -config.margin:
            verdict = "falls short"
        else:
            verdict = "undecided"
        out["arms"][arm] = {"difference": interval, "verdict": verdict}
    gain = None if reference is None else reference["gain"]["mean"]
    complete = reference is not None and all(
        arms.get(f"{update}/{arm}") is not None and len(arms[f"{update}/{arm}"]["seeds"]) == len(config.seeds)
        for arm in (REFERENCE, "otb4", "gm4", "rloo4"))
    out["gm32_gain"] = gain
    out["complete"] = bool(complete)
    verdicts = {arm: out["arms"].get(arm, {}).get("verdict") for arm in ("otb4", "gm4", "rloo4")}
    if not complete:
        claim = "void (incomplete: a run of otb4, gm4, rloo4 or gm32 is missing)"
    elif gain is None or gain < config.min_reference_gain:
        claim = f"void (gm32 gained {gain:.3f} < {config.min_reference_gain})"
    elif verdicts["otb4"] == "falls short":
        claim = "not supported (otb4 falls short of gm32)"
    elif verdicts["gm4"] == "matches" or verdicts["rloo4"] == "matches":
        which = " and ".join(arm for arm in ("gm4", "rloo4") if verdicts[arm] == "matches")
        verb = "match" if " and " in which else "matches"
        claim = (f"not supported ({which} also {verb} gm32: N = 4 suffices without OTB)" if verdicts["otb4"] ==
                 "matches" else f"not supported ({which} {verb} gm32, otb4 undecided)")
    elif verdicts["otb4"] == "matches" and verdicts["gm4"] == "falls short" and verdicts["rloo4"] == "falls short":
        claim = "supported"
    else:
        claim = "undecided"
    out["claim"] = claim
    out["secondary"] = _learning_speed(arms, update, config)
    return out


def _learning_speed(arms: dict, update: str, config: Config) -> dict:
    """Secondary, pre-registered: otb4 against each other N = 4 arm on the mean held-out accuracy over the run's
    evaluations (the area under its accuracy-vs-tokens curve over the common budget, divided by the budget), paired by
    seed: *otb4 faster* if the t-interval of the mean difference lies above 0, *slower* if below, else *not
    resolved*."""
    base = arms.get(f"{update}/otb4")
    out = {}
    for other in ("gm4", "rloo4", "loo4"):
        entry = arms.get(f"{update}/{other}")
        if base is None or entry is None:
            continue
        mine = dict(zip(base["seeds"], base["mean_accuracy_over_run"]))
        theirs = dict(zip(entry["seeds"], entry["mean_accuracy_over_run"]))
        interval = _interval([mine[s] - theirs[s] for s in mine if s in theirs], config.confidence)
        verdict = ("otb4 faster" if interval["low"] > 0 else "otb4 slower" if interval["high"] < 0
                   else "not resolved")
        out[f"otb4 - {other}"] = {"difference": interval, "verdict": verdict}
    return out


def run_all(configs: list[Config] | tuple[Config, ...], out_dir: str, *, progress: bool = True,
            train: bool = True) -> dict[str, dict]:
    """Run (or resume) every set-up into ``out_dir/<name>/``, then write ``out_dir/report.md``,
    ``out_dir/accuracy_vs_tokens.png`` and ``out_dir/summary.json`` (the results less the per-step series) from all
    the finished runs. With ``train=False`` nothing is trained: the
    finished runs are summarized as they are (a partial report says so). Returns {name: results}."""
    from otb_experiment import report

    for config in configs:
        check_config(config, os.path.join(out_dir, config.name))
    bar = None
    if progress and train:
        total = done = 0
        for config in configs:
            runs_dir = os.path.join(out_dir, config.name, "runs")
            for update, arm, seed in plan_of(config):
                total += work_of(config, arm)
                if os.path.exists(os.path.join(runs_dir, f"{update}-{arm}-seed{seed}.json")):
                    done += work_of(config, arm)
        bar = _Progress(total, done)
    results = {}
    for config in configs:
        directory = os.path.join(out_dir, config.name)
        if train:
            results[config.name] = run_experiment(config, directory, progress=bar if bar is not None else False)
        else:
            runs_dir = os.path.join(directory, "runs")
            os.makedirs(runs_dir, exist_ok=True)
            results[config.name] = summarize(config, runs_dir)
            _write_json(os.path.join(directory, "results.json"), results[config.name])
    if bar is not None:
        bar.stream.write("\n" if not bar.line_mode else "")
    with open(os.path.join(out_dir, "report.md"), "w", encoding="utf-8") as handle:
        handle.write(report.markdown(results))
    _write_json(os.path.join(out_dir, "summary.json"), {name: _compact(result) for name, result in results.items()})
    if any(result["arms"] for result in results.values()):
        report.plot(results, os.path.join(out_dir, "accuracy_vs_tokens.png"))
    return results
