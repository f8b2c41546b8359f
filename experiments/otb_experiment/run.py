"""Training, measurement and the whole experiment: `otb-spec experiment` (docs/experiment.md).

One *run* is (update rule, arm, seed): from the seed's supervised warm start, RL on the task for a fixed number of
steps with ``prompts_per_step`` prompts and the arm's N samples each, evaluated on the held-out split every
``eval_every`` steps. Arms differ only in N and in how advantages are computed (all by otb_torch):

  gm32   group mean, N = 32 (GRPO without std normalisation)
  otb4   verl's OTB (self-inclusive, zero tail), N = 4
  loo4   leave-one-out OTB, N = 4
  gm4    group mean, N = 4
  rloo4  RLOO, N = 4

Update rules: ``pg`` — plain policy gradient, loss = −(1/B)·Σᵢ Σₜ Aₜⁱ log π(yₜⁱ), one step per batch; ``ppo`` — verl-like
PPO clipping (ε = 0.2) with token-mean aggregation over two mini-batches per batch (the second is off-policy).
Everything is deterministic on CPU for a fixed seed (one torch thread).
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import numpy as np
import torch

import otb_torch
from otb_experiment import task
from otb_experiment.policy import Policy, Rollouts, greedy, sample, teacher_forced, token_log_probs, token_statistics

__all__ = ["ARMS", "UPDATES", "Config", "QUICK", "FULL", "run_experiment", "arm_advantages"]

ARMS = {"gm32": ("group_mean", 32), "otb4": ("otb", 4), "loo4": ("leave_one_out", 4), "gm4": ("group_mean", 4),
        "rloo4": ("rloo", 4)}
UPDATES = ("pg", "ppo")


@dataclass(frozen=True)
class Config:
    """Every knob of the experiment (recorded in the results)."""

    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    arms: tuple[str, ...] = tuple(ARMS)
    updates: tuple[str, ...] = UPDATES
    min_digits: int = 4
    max_digits: int = 16
    sft_steps_max: int = 3000
    sft_batch: int = 64
    sft_target_accuracy: float = 0.3
    train_prompts: int = 20000
    test_prompts: int = 256
    prompts_per_step: int = 16
    steps: dict = field(default_factory=lambda: {"gm32": 150, "otb4": 450, "loo4": 450, "gm4": 450, "rloo4": 450})
    learning_rate: float = 3e-4
    eval_every: int = 15
    variance_resamples: int = 16
    proxy_sequences: int = 12
    checkpoint_every: int = 30
    samples_override: int | None = None          # N for every N = 4 arm (tests: N < 2 is rejected)

    @property
    def max_response(self) -> int:
        return 2 * self.max_digits + 1


FULL = Config()
QUICK = Config(seeds=(0,), updates=("pg",), max_digits=6, sft_steps_max=150, sft_target_accuracy=0.05,
               train_prompts=512, test_prompts=32, prompts_per_step=4,
               steps={"gm32": 3, "otb4": 6, "loo4": 6, "gm4": 6, "rloo4": 6}, eval_every=3, variance_resamples=3,
               proxy_sequences=2, checkpoint_every=3)


def _samples(config: Config, arm: str) -> int:
    kind, samples = ARMS[arm]
    return samples if (samples != 4 or config.samples_override is None) else config.samples_override


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
    return task.Prompts(pool.tokens[rows], pool.digits[rows])


def accuracy(policy: Policy, prompts: task.Prompts, max_length: int) -> float:
    tokens, lengths = greedy(policy, prompts, max_length)
    return float(task.rewards_of(prompts, tokens, lengths).mean())


def _splits(config: Config, seed: int) -> tuple[task.Prompts, task.Prompts]:
    rng = np.random.default_rng([seed, 1])
    return (task.make_prompts(rng, config.train_prompts, config.min_digits, config.max_digits),
            task.make_prompts(rng, config.test_prompts, config.min_digits, config.max_digits))


def warm_start(config: Config, seed: int, train: task.Prompts, test: task.Prompts,
               report: Callable[[str], None] | None = None) -> tuple[dict, dict]:
    """Supervised fine-tuning on targets until held-out accuracy reaches ``sft_target_accuracy`` (checked every 50
    steps) or ``sft_steps_max``; returns (state dict, summary)."""
    torch.manual_seed(seed)
    policy = Policy()
    optimizer = torch.optim.Adam(policy.parameters(), lr=3e-3)
    rng = np.random.default_rng([seed, 2])
    reached, step = accuracy(policy, test, config.max_response), 0
    while step < config.sft_steps_max and reached < config.sft_target_accuracy:
        rows = rng.integers(0, len(train.digits), config.sft_batch)
        prompts = _prompts_at(train, rows)
        answers = task.targets(prompts)
        tokens = torch.full((len(rows), config.max_response), task.PAD, dtype=torch.int64)
        for row, answer in enumerate(answers):
            tokens[row, :len(answer)] = torch.from_numpy(answer)
        lengths = np.array([len(answer) for answer in answers])
        mask = (torch.arange(config.max_response)[None, :] < torch.from_numpy(lengths)[:, None]).float()
        logits = teacher_forced(policy, prompts, Rollouts(tokens, mask, lengths, np.arange(len(rows))))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, task.VOCAB), tokens.reshape(-1), reduction="none")
        loss = (loss * mask.reshape(-1)).sum() / mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        if step % 50 == 0:
            reached = accuracy(policy, test, config.max_response)
            if report is not None:
                report(f"warm start seed {seed}: step {step}, accuracy {reached:.2f}")
    return policy.state_dict(), {"sft_steps": step, "sft_accuracy": reached}


def _policy_loss(update: str, policy: Policy, prompts: task.Prompts, rollouts, advantages: torch.Tensor,
                 old_log_probs: torch.Tensor | None, rows: slice | None = None) -> torch.Tensor:
    log_probs = token_log_probs(teacher_forced(policy, prompts, rollouts), rollouts.tokens)
    mask = rollouts.mask
    if update == "pg":
        return -(advantages * log_probs * mask).sum() / mask.shape[0]
    ratio = torch.exp(log_probs - old_log_probs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    per_token = -torch.minimum(ratio * advantages, clipped * advantages)
    return (per_token * mask).sum() / mask.sum().clamp(min=1.0)


def _subset(rollouts, rows: np.ndarray):
    index = torch.from_numpy(rows)
    return type(rollouts)(rollouts.tokens[index], rollouts.mask[index], rollouts.lengths[rows],
                          rollouts.prompt_rows[rows])


def _rollout_advantages(arm: str, policy: Policy, prompts: task.Prompts, samples: int, generator: torch.Generator,
                        max_length: int) -> tuple[Any, np.ndarray, Any, torch.Tensor]:
    """Sample N responses per prompt, score them, and compute the arm's advantages from the model's own token
    statistics (masked positions get log π = 0, Σπ² = 1). Returns (rollouts, rewards [B], statistics, advantages)."""
    rollouts = sample(policy, prompts, samples, generator, max_length)
    rewards_np = task.rewards_of(_prompts_at(prompts, rollouts.prompt_rows), rollouts.tokens.numpy(),
                                 rollouts.lengths)
    with torch.no_grad():
        stats = token_statistics(teacher_forced(policy, prompts, rollouts), rollouts.tokens)
    mask = rollouts.mask
    advantages = arm_advantages(arm, _terminal_rewards(rewards_np, mask), mask, rollouts.prompt_rows,
                                stats.log_probs * mask, stats.sum_pi_squared * mask + (1 - mask))
    return rollouts, rewards_np, stats, advantages


def train_step(update: str, arm: str, policy: Policy, optimizer: torch.optim.Optimizer, prompts: task.Prompts,
               samples: int, generator: torch.Generator, max_length: int) -> dict:
    """One RL step; returns the step's statistics (tokens consumed, mean reward, entropy, loss)."""
    rollouts, rewards_np, stats, advantages = _rollout_advantages(arm, policy, prompts, samples, generator,
                                                                  max_length)
    mask = rollouts.mask
    losses = []
    if update == "pg":
        loss = _policy_loss("pg", policy, prompts, rollouts, advantages, None)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    else:
        old = stats.log_probs.detach()
        halves = np.array_split(np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=generator)))
                                .permutation(len(rewards_np)), 2)
        for rows in halves:
            part = _subset(rollouts, rows)
            loss = _policy_loss("ppo", policy, prompts, part, advantages[torch.from_numpy(rows)],
                                old[torch.from_numpy(rows)])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
    entropy = float((stats.entropy * mask).sum() / mask.sum())
    return {"tokens": int(mask.sum()), "reward": float(rewards_np.mean()), "entropy": entropy,
            "loss": float(np.mean(losses))}


def gradient_variance(policy: Policy, train: task.Prompts, config: Config, seed: int) -> dict:
    """Per arm, at the current parameters: the total variance tr Cov(ĝ) of the pg gradient estimate from
    ``prompts_per_step`` fresh prompts, over ``variance_resamples`` independent batches, with its standard error
    (from the spread of the squared deviations), and ‖E ĝ‖²."""
    out = {}
    for arm in config.arms:
        rng = np.random.default_rng([seed, 3])
        generator = torch.Generator().manual_seed(seed * 1000 + 7)
        grads = []
        for _ in range(config.variance_resamples):
            prompts = _prompts_at(train, rng.integers(0, len(train.digits), config.prompts_per_step))
            rollouts, _, _, advantages = _rollout_advantages(arm, policy, prompts, _samples(config, arm), generator,
                                                             config.max_response)
            policy.zero_grad()
            _policy_loss("pg", policy, prompts, rollouts, advantages, None).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in policy.parameters()]).numpy().copy())
        g = np.stack(grads)
        deviations = np.square(g - g.mean(0)).sum(1) * len(g) / (len(g) - 1)
        out[arm] = {"total_variance": float(deviations.mean()),
                    "total_variance_se": float(deviations.std(ddof=1) / math.sqrt(len(g))),
                    "mean_gradient_sq_norm": float(np.square(g.mean(0)).sum())}
    policy.zero_grad()
    return out


def proxy_correlation(policy: Policy, train: task.Prompts, config: Config, seed: int) -> dict:
    """On sampled sequences: the proxy wₜ = 1 − 2π + Σπ² against the exact ‖∇θ log π(yₜ)‖², and the realized energy
    Wₜ against the exact ‖Sₜ‖² = ‖∇θ Σ_{j≤t} log π(yⱼ)‖² (Pearson and Spearman correlations)."""
    rng = np.random.default_rng([seed, 4])
    prompts = _prompts_at(train, rng.integers(0, len(train.digits), config.proxy_sequences))
    rollouts = sample(policy, prompts, 1, torch.Generator().manual_seed(seed), config.max_response)
    parameters = list(policy.parameters())
    proxy, exact, energy, cumulative = [], [], [], []
    for row in range(len(prompts.digits)):
        one = _subset(rollouts, np.array([row]))
        single = _prompts_at(prompts, np.array([one.prompt_rows[0]]))
        one = one._replace(prompt_rows=np.array([0]))
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
            flat = torch.cat([g.reshape(-1) for g in grads])
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
        spearman = float(np.corrcoef(rank(x), rank(y))[0, 1]) if len(x) > 1 else float("nan")
        return {"pearson": pearson, "spearman": spearman, "tokens": len(x)}

    return {"token": correlations(proxy, exact), "cumulative": correlations(energy, cumulative)}


def _write_json(path: str, payload: Any) -> None:
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as handle:
        json.dump(payload, handle, indent=1, sort_keys=True)
    os.replace(temporary, path)


class _Progress:
    """One line on stderr: completed work units, the current run, and an ETA from the rate so far."""

    def __init__(self, total_units: int, done_units: int = 0):
        self.total, self.done, self.start = total_units, done_units, time.monotonic()
        self.started_from = done_units

    def note(self, label: str) -> None:
        """Redraw with a new label (work that the ETA does not count, such as a warm start)."""
        self.advance(0, label)

    def advance(self, units: int, label: str) -> None:
        self.done += units
        elapsed = time.monotonic() - self.start
        rate = (self.done - self.started_from) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        filled = int(30 * self.done / max(self.total, 1))
        eta_text = "?" if math.isinf(eta) else f"{int(eta // 60)}m{int(eta % 60):02d}s"
        sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {100 * self.done / max(self.total, 1):5.1f}% "
                         f"{label:<40s} ETA {eta_text}   ")
        sys.stderr.flush()


def _check_config(config: Config, out_dir: str) -> None:
    unknown = [arm for arm in config.arms if arm not in ARMS]
    if unknown:
        raise ValueError(f"arms: unknown arm {unknown[0]!r}; choose from {sorted(ARMS)}")
    bad = [update for update in config.updates if update not in UPDATES]
    if bad:
        raise ValueError(f"updates: unknown update rule {bad[0]!r}; choose from {list(UPDATES)}")
    if config.samples_override is not None and config.samples_override < 2:
        raise ValueError(f"samples: N must be at least 2 (a group needs another member), got {config.samples_override}")
    if not config.seeds:
        raise ValueError("seeds: need at least one seed")
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, ".write-test")
        with open(probe, "w", encoding="utf-8") as handle:
            handle.write("")
        os.remove(probe)
    except OSError as exc:
        raise ValueError(f"out: cannot write the output directory {out_dir!r} ({exc.strerror or exc})") from exc


def run_experiment(config: Config, out_dir: str, *, progress: bool = True,
                   log: Callable[[str], None] | None = None) -> dict:
    """Run (or resume) every (update, arm, seed), then write ``results.json`` and ``accuracy_vs_tokens.png``.

    Finished runs are stored as ``runs/<update>-<arm>-seed<s>.json`` and never redone; an unfinished run resumes from
    its last checkpoint in ``checkpoints/``. Returns the results dictionary.
    """
    _check_config(config, out_dir)
    torch.set_num_threads(1)
    runs_dir, checkpoints = os.path.join(out_dir, "runs"), os.path.join(out_dir, "checkpoints")
    os.makedirs(runs_dir, exist_ok=True)
    os.makedirs(checkpoints, exist_ok=True)
    plan = [(update, arm, seed) for seed in config.seeds for update in config.updates for arm in config.arms]
    weight = {arm: config.steps[arm] * _samples(config, arm) for arm in config.arms}
    total = sum(weight[arm] for _, arm, _ in plan)
    done = sum(weight[arm] for update, arm, seed in plan
               if os.path.exists(os.path.join(runs_dir, f"{update}-{arm}-seed{seed}.json")))
    bar = _Progress(total, done) if progress else None
    warm: dict[int, tuple[dict, dict]] = {}
    for update, arm, seed in plan:
        path = os.path.join(runs_dir, f"{update}-{arm}-seed{seed}.json")
        if os.path.exists(path):
            continue
        train, test = _splits(config, seed)
        if seed not in warm:
            warm_path = os.path.join(checkpoints, f"warm-seed{seed}.pt")
            if os.path.exists(warm_path):
                warm[seed] = torch.load(warm_path, weights_only=False)
            else:
                warm[seed] = warm_start(config, seed, train, test, None if bar is None else bar.note)
                torch.save(warm[seed], warm_path)
        result = _one_run(config, update, arm, seed, train, test, warm[seed], checkpoints, bar)
        _write_json(path, result)
    if bar is not None:
        sys.stderr.write("\n")
    results = summarize(config, runs_dir)
    _write_json(os.path.join(out_dir, "results.json"), results)
    plot(results, os.path.join(out_dir, "accuracy_vs_tokens.png"))
    return results


def _one_run(config: Config, update: str, arm: str, seed: int, train: task.Prompts, test: task.Prompts,
             warm: tuple[dict, dict], checkpoints: str, bar: _Progress | None) -> dict:
    checkpoint = os.path.join(checkpoints, f"{update}-{arm}-seed{seed}.pt")
    policy = Policy()
    policy.load_state_dict(warm[0])
    optimizer = torch.optim.Adam(policy.parameters(), lr=config.learning_rate)
    generator = torch.Generator().manual_seed(seed * 7919 + list(ARMS).index(arm) * 31 + UPDATES.index(update))
    rng = np.random.default_rng([seed, 5, list(ARMS).index(arm)])
    diverged = False
    if os.path.exists(checkpoint):
        saved = torch.load(checkpoint, weights_only=False)
        policy.load_state_dict(saved["policy"])
        optimizer.load_state_dict(saved["optimizer"])
        generator.set_state(saved["generator"])
        rng.bit_generator.state = saved["rng"]
        history, start, tokens, extra = saved["history"], saved["step"], saved["tokens"], saved["extra"]
    else:                                                   # the warm start's accuracy: evaluated on a fresh run only
        history = {"step": [0], "tokens": [0], "accuracy": [accuracy(policy, test, config.max_response)],
                   "reward": [], "entropy": [], "loss": []}
        start, tokens, extra = 0, 0, {}
    samples = _samples(config, arm)
    steps = config.steps[arm]
    if start == 0 and update == "pg":
        extra["variance_start"] = gradient_variance(policy, train, config, seed) if arm == config.arms[0] else None
        extra["proxy_start"] = proxy_correlation(policy, train, config, seed) if arm == config.arms[0] else None
    for step in range(start, steps):
        prompts = _prompts_at(train, rng.integers(0, len(train.digits), config.prompts_per_step))
        stats = train_step(update, arm, policy, optimizer, prompts, samples, generator, config.max_response)
        tokens += stats["tokens"]
        for key in ("reward", "entropy", "loss"):
            history[key].append(stats[key])
        if not all(math.isfinite(float(p.detach().abs().max())) for p in policy.parameters()):
            diverged = True
            break
        if (step + 1) % config.eval_every == 0 or step + 1 == steps:
            history["step"].append(step + 1)
            history["tokens"].append(tokens)
            history["accuracy"].append(accuracy(policy, test, config.max_response))
        if bar is not None:
            bar.advance(samples, f"{update} {arm} seed {seed} step {step + 1}/{steps}")
        if (step + 1) % config.checkpoint_every == 0 and step + 1 < steps:
            torch.save({"policy": policy.state_dict(), "optimizer": optimizer.state_dict(),
                        "generator": generator.get_state(), "rng": rng.bit_generator.state, "history": history,
                        "step": step + 1, "tokens": tokens, "extra": extra}, checkpoint)
    if diverged and bar is not None:
        bar.advance(samples * (steps - len(history["reward"])), f"{update} {arm} seed {seed} diverged")
    if update == "pg" and arm == config.arms[0] and not diverged:
        extra["variance_end"] = gradient_variance(policy, train, config, seed)
    collapsed = bool(history["entropy"] and history["entropy"][-1] < 0.01 and history["accuracy"][-1] < 0.9)
    if os.path.exists(checkpoint):
        os.remove(checkpoint)
    return {"update": update, "arm": arm, "seed": seed, "samples": samples, "steps": steps, "history": history,
            "diverged": diverged, "collapsed": collapsed, "warm_start": warm[1], **extra}


def summarize(config: Config, runs_dir: str) -> dict:
    """Collect the finished runs into per-(update, arm) summaries: final accuracy and tokens (mean ± SE over seeds),
    the tokens at which each run first reached the gm32 run's final accuracy (same seed and update), and the
    pre-registered decision (docs/experiment.md)."""
    runs = {}
    for name in sorted(os.listdir(runs_dir)):
        if name.endswith(".json"):
            with open(os.path.join(runs_dir, name), encoding="utf-8") as handle:
                record = json.load(handle)
            runs[(record["update"], record["arm"], record["seed"])] = record

    def mean_se(values: list[float]) -> dict:
        array = np.asarray(values, dtype=float)
        se = float(array.std(ddof=1) / math.sqrt(len(array))) if len(array) > 1 else float("nan")
        return {"mean": float(array.mean()), "se": se, "n": len(array)}

    summary: dict = {"config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(config).items()},
                     "arms": {}, "decision": {}}
    for update in config.updates:
        for arm in config.arms:
            records = [runs[(update, arm, seed)] for seed in config.seeds if (update, arm, seed) in runs]
            if not records:
                continue
            reach = []
            for record in records:
                reference = runs.get((update, "gm32", record["seed"]))
                reach.append(_tokens_to_reach(record, reference))
            summary["arms"][f"{update}/{arm}"] = {
                "final_accuracy": mean_se([r["history"]["accuracy"][-1] for r in records]),
                "tokens": mean_se([r["history"]["tokens"][-1] for r in records]),
                "start_accuracy": mean_se([r["history"]["accuracy"][0] for r in records]),
                "tokens_to_reach_gm32_final_fraction": reach,
                "diverged": sum(r["diverged"] for r in records), "collapsed": sum(r["collapsed"] for r in records),
                "variance_start": [r.get("variance_start") for r in records if r.get("variance_start")],
                "variance_end": [r.get("variance_end") for r in records if r.get("variance_end")],
                "proxy_start": [r.get("proxy_start") for r in records if r.get("proxy_start")],
                "curves": [{"tokens": r["history"]["tokens"], "accuracy": r["history"]["accuracy"]} for r in records],
            }
        summary["decision"][update] = _decision(summary["arms"], update, len(config.seeds))
    return summary


def _tokens_to_reach(record: dict, reference: dict | None) -> float | None:
    """Tokens this run needed to first reach the reference (gm32) run's final accuracy, as a fraction of the
    reference's tokens; None when it never did (or there is no reference)."""
    if reference is None:
        return None
    target = reference["history"]["accuracy"][-1]
    budget = reference["history"]["tokens"][-1]
    for tokens, value in zip(record["history"]["tokens"], record["history"]["accuracy"]):
        if value >= target:
            return tokens / budget if budget else None
    return None


def _decision(arms: dict, update: str, seeds: int) -> dict:
    """The pre-registered rule (docs/experiment.md): OTB(4) reaches GM(32)'s final accuracy with ≤ 35 % of its tokens
    in ≥ 4 of 5 seeds, and GM(4) and RLOO(4) do not (each in at most 3 of 5); valid only if GM(32) itself gains at
    least 0.05 in mean held-out accuracy over the warm start."""
    def successes(arm: str) -> int | None:
        entry = arms.get(f"{update}/{arm}")
        if entry is None:
            return None
        return sum(1 for fraction in entry["tokens_to_reach_gm32_final_fraction"]
                   if fraction is not None and fraction <= 0.35)
    counts = {arm: successes(arm) for arm in ("otb4", "loo4", "gm4", "rloo4")}
    needed = math.ceil(0.8 * seeds)
    reference = arms.get(f"{update}/gm32")
    gain = None if reference is None else reference["final_accuracy"]["mean"] - reference["start_accuracy"]["mean"]
    valid = gain is not None and gain >= 0.05          # GM(32) must itself learn, or the comparison says nothing
    holds = (valid and counts["otb4"] is not None and counts["otb4"] >= needed
             and all(counts[arm] is not None and counts[arm] < needed for arm in ("gm4", "rloo4")))
    return {"successes_within_35_percent": counts, "needed": needed, "gm32_gain": gain, "valid": bool(valid),
            "claim_supported": bool(holds)}


def plot(results: dict, path: str) -> None:
    """Held-out accuracy vs tokens consumed, mean ± SE over seeds per arm, one panel per update rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    updates = sorted({key.split("/")[0] for key in results["arms"]})
    figure, axes = plt.subplots(1, max(len(updates), 1), figsize=(6 * max(len(updates), 1), 4), squeeze=False)
    for axis, update in zip(axes[0], updates):
        for key, entry in results["arms"].items():
            if not key.startswith(update + "/"):
                continue
            curves = entry["curves"]
            length = min(len(c["tokens"]) for c in curves)
            tokens = np.mean([c["tokens"][:length] for c in curves], axis=0)
            values = np.array([c["accuracy"][:length] for c in curves])
            mean = values.mean(0)
            se = values.std(0, ddof=1) / math.sqrt(len(values)) if len(values) > 1 else np.zeros_like(mean)
            axis.plot(tokens, mean, label=key.split("/")[1])
            axis.fill_between(tokens, mean - se, mean + se, alpha=0.2)
        axis.set_xlabel("response tokens consumed")
        axis.set_ylabel("held-out exact-match accuracy")
        axis.set_title(f"update: {update} (mean ± SE over seeds)")
        axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
