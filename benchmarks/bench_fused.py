"""Token statistics from hidden states and the LM head: otb_torch's fused kernel against verl 0.9.1's two paths.

    python benchmarks/bench_fused.py [--tokens 2048,4096] [--hidden 1024] [--vocab 65536] [--repeats 3]
                                     [--device cpu|cuda] [--dtype float32|bfloat16] [--methods …]

For hidden [N, H] and the LM head W [V, H] (float32, N(0, 1) hidden states and N(0, 0.02²) weights: logits of
magnitude ~1, as a trained model's), with τ = 1, each method in a fresh subprocess, in the same environment:

* ``(a) verl unfused`` — what verl's FSDP engine does without fused kernels: logits = h·Wᵀ (materialised), then
  ``verl.utils.torch_functional.calculate_sum_pi_squared_from_logits``, ``logprobs_from_logits`` (log-softmax and
  gather) and ``entropy_from_logits``: log π, entropy and Σπ²;
* ``(b) verl FusedLinearForPPO`` — verl's fused torch backend (``verl.utils.experimental.torch_functional``, chunks
  of 512 tokens): log π and entropy only (it has no Σπ², which is why verl refuses OTB with fused kernels);
* ``otb_torch fused`` — :func:`otb_torch.fused_linear_token_statistics` with its default blocks: all three;
* ``otb_torch fused (torch ops)`` — the same with ``OTB_TORCH_NATIVE=0``: each block's elementwise work in torch ops
  instead of the native CPU kernel (what runs without a C compiler; the A/B of the native block kernels);
* ``unfused (torch ops)`` — where verl is not importable (the default there in place of (a) and (b)): the logits
  held as in (a), the statistics by their formulas in torch ops (log_softmax + gather, lse − Σ π·z,
  exp(lse(2z) − 2·lse(z)));
* ``matmul floor`` — the matmuls alone, on the same blocks: z = h·Wᵀ forward; z again, ∂h += ∂z·W and ∂W += ∂zᵀ·h
  backward. Any method that never holds the logits does these four N·V·H products for forward + backward (verl's
  fused path too), so ``(b)`` cannot be beaten by more than its time above this floor.

``forward`` computes the statistics without gradient; ``forward + backward`` computes them with gradients and runs
the backward pass of Σ (g_lp·log π + g_H·H) for fixed random cotangents (a policy loss with an entropy term), giving
∂h and ∂W. Memory: of the first full-size call (after a call at tiny sizes sets up the libraries; later calls reuse
what the allocator kept), the peak resident set (VmHWM, reset through /proc/self/clear_refs just before it; CUDA:
``torch.cuda.max_memory_allocated``) minus what was resident before it, minus, for forward + backward, the returned
gradients (N·H + V·H floats): the *extra* memory of the method. Time: then the best of ``--repeats`` calls (wall
clock). The fp32 logits (N·V floats) are the unit: the targets of issue 23 are extra memory ≤ 0.1× the
logits that does not grow with N, forward + backward time ≤ 0.6× path (b), and time ≤ path (a).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
METHODS = ("(a) verl unfused", "(b) verl FusedLinearForPPO", "otb_torch fused", "otb_torch fused (torch ops)",
           "matmul floor", "unfused (torch ops)")
VERL_METHODS = METHODS[:2]
DEFAULT_METHODS = METHODS[:5]                   # with verl importable; without it, (a) and (b) become the line below
WITHOUT_VERL = ("unfused (torch ops)", "otb_torch fused", "otb_torch fused (torch ops)", "matmul floor")

_CHILD = r"""
import json, os, sys, time, torch
sys.path[:0] = [os.path.join(sys.argv[1], "adapters"), sys.argv[1]]
method, mode, device, dtype_name = sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5]
tokens, hidden_size, vocab, repeats = (int(value) for value in sys.argv[6:10])
dtype = getattr(torch, dtype_name)
import otb_torch
if method.startswith("(a) verl") or method.startswith("(b) verl"):
    from verl.utils import torch_functional as verl_F
    from verl.utils.experimental.torch_functional import FusedLinearForPPO
    verl_fused = FusedLinearForPPO()

def unfused(h, w, ids):
    logits = (h @ w.t()).float()
    return (verl_F.logprobs_from_logits(logits, ids), verl_F.entropy_from_logits(logits),
            verl_F.calculate_sum_pi_squared_from_logits(logits))

def unfused_torch_ops(h, w, ids):
    # the logits held, then the three statistics by their textbook formulas: log_softmax + gather, lse − Σ π·z,
    # exp(lse(2z) − 2·lse(z)) — the materialising baseline where verl is not importable
    logits = (h @ w.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, None]).squeeze(-1)
    entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return log_probs, entropy, torch.exp(torch.logsumexp(2 * logits, dim=-1) - 2 * lse).detach()

class _MatmulFloor(torch.autograd.Function):
    # only the matmuls any method that never holds the logits must do, on otb_torch's default blocks: forward
    # z = h·Wᵀ; backward z again, ∂h += ∂z·W, ∂W += ∂zᵀ·h (∂z = the block itself: no elementwise work), in the
    # inputs' dtype (bf16 products for bf16 inputs: the least a half-precision method must do)

    @staticmethod
    def forward(ctx, h, w):
        rows, columns = otb_torch._fused._blocks(h.shape[0], w.shape[0], h.device, torch.float32, w.dtype,
                                                 h.shape[1], None, None)
        block = torch.empty(min(rows, h.shape[0]) * columns, dtype=h.dtype, device=h.device)
        for start in range(0, w.shape[0], columns):
            for first in range(0, h.shape[0], rows):
                z = block[:min(rows, h.shape[0] - first) * min(columns, w.shape[0] - start)].view(
                    min(rows, h.shape[0] - first), -1)
                torch.mm(h[first:first + rows], w[start:start + columns].t(), out=z)
        ctx.save_for_backward(h, w); ctx.blocks = (rows, columns)
        return h.new_zeros(h.shape[0]), h.new_zeros(h.shape[0])

    @staticmethod
    def backward(ctx, *_):
        h, w = ctx.saved_tensors; rows, columns = ctx.blocks
        dh, dw = torch.zeros_like(h), torch.zeros_like(w)
        block = torch.empty(min(rows, h.shape[0]) * columns, dtype=h.dtype, device=h.device)
        for start in range(0, w.shape[0], columns):
            for first in range(0, h.shape[0], rows):
                z = block[:min(rows, h.shape[0] - first) * min(columns, w.shape[0] - start)].view(
                    min(rows, h.shape[0] - first), -1)
                torch.mm(h[first:first + rows], w[start:start + columns].t(), out=z)
                dh[first:first + rows].addmm_(z, w[start:start + columns])
                dw[start:start + columns].addmm_(z.t(), h[first:first + rows])
        return dh, dw

function = {
    "(a) verl unfused": unfused,
    "(b) verl FusedLinearForPPO": lambda h, w, ids: verl_fused(h, w, ids, 1.0),
    "unfused (torch ops)": unfused_torch_ops,
    "otb_torch fused": lambda h, w, ids: otb_torch.fused_linear_token_statistics(h, w, ids),
    "otb_torch fused (torch ops)": lambda h, w, ids: otb_torch.fused_linear_token_statistics(h, w, ids),
    "matmul floor": lambda h, w, ids: _MatmulFloor.apply(h, w),
}[method]
generator = torch.Generator(device="cpu").manual_seed(0)
hidden = torch.randn(tokens, hidden_size, generator=generator).to(device=device, dtype=dtype)
weight = (0.02 * torch.randn(vocab, hidden_size, generator=generator)).to(device=device, dtype=dtype)
ids = torch.randint(0, vocab, (tokens,), generator=generator).to(device)
g_lp = torch.randn(tokens, generator=generator).to(device)
g_h = 0.01 * torch.randn(tokens, generator=generator).to(device)
backward = mode == "forward + backward"

def call():
    h = hidden.detach().requires_grad_(backward)
    w = weight.detach().requires_grad_(backward)
    with torch.set_grad_enabled(backward):
        outputs = function(h, w, ids)
        if backward:
            (outputs[0].float() * g_lp + outputs[1].float() * g_h).sum().backward()
    return h.grad, w.grad

def resident():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))

def sync():
    if device == "cuda":
        torch.cuda.synchronize()

small = (hidden[:2].detach().requires_grad_(backward), weight[:64].detach().requires_grad_(backward), ids[:2] % 64)
with torch.set_grad_enabled(backward):                  # one-time library set-up (thread pools, kernels), tiny sizes
    outputs = function(*small)
    if backward:
        (outputs[0].float().sum() + outputs[1].float().sum()).backward()
sync()
# memory of the first full-size call: later calls reuse what the allocator kept from earlier ones
if device == "cuda":
    torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
    gradients = call(); sync(); peak = torch.cuda.max_memory_allocated() - base
else:
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")                                # the high-water mark restarts at the current resident set
    base = resident(); gradients = call(); peak = resident() - base
returned = sum(g.numel() * g.element_size() for g in gradients if g is not None)
del gradients
times = []
for _ in range(repeats):
    sync(); start = time.perf_counter(); call(); sync(); times.append(time.perf_counter() - start)
print(json.dumps({"seconds": min(times), "extra": peak - returned, "logits": tokens * vocab * 4}))
"""


def measure(method: str, mode: str, args: argparse.Namespace, tokens: int) -> dict:
    command = [sys.executable, "-c", _CHILD, ROOT, method, mode, args.device, args.dtype, str(tokens),
               str(args.hidden), str(args.vocab), str(args.repeats)]
    environment = {**os.environ, "PYTHONWARNINGS": "ignore"}
    if method == "otb_torch fused (torch ops)":        # the block's elementwise work in torch ops, as without a compiler
        environment["OTB_TORCH_NATIVE"] = "0"
    result = subprocess.run(command, capture_output=True, text=True, env=environment)
    if result.returncode != 0:
        raise RuntimeError(f"{method} ({mode}) failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", default="2048,4096", help="comma-separated token counts N")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--methods", default="",
                        help="comma-separated subset of: " + ", ".join(METHODS) + " (the targets need (a), (b), "
                             "otb_torch fused and the matmul floor; default: those and otb_torch fused (torch ops) "
                             "where verl is importable, else " + ", ".join(WITHOUT_VERL) + "; on CUDA without "
                             "otb_torch fused (torch ops), the same code there)")
    args = parser.parse_args()
    has_verl = importlib.util.find_spec("verl") is not None     # a broken install then fails in the child, loudly
    if args.methods:
        methods = [name.strip() for name in args.methods.split(",")]
    else:
        methods = [name for name in (DEFAULT_METHODS if has_verl else WITHOUT_VERL)
                   if not (args.device == "cuda" and name == "otb_torch fused (torch ops)")]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"--methods: unknown {unknown}; choose from {list(METHODS)}")
    if not has_verl and set(methods) & set(VERL_METHODS):
        parser.error(f"--methods: {sorted(set(methods) & set(VERL_METHODS))} need verl, which is not importable here")
    token_counts = [int(value) for value in args.tokens.split(",")]
    print(f"# fused token statistics, {args.device}, {args.dtype}, H = {args.hidden}, V = {args.vocab}, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print("\n| N | pass | method | time (s) | extra peak memory | × the fp32 logits |")
    print("|---|------|--------|---------:|------------------:|------------------:|")
    results: dict = {}
    for tokens in token_counts:
        for mode in ("forward", "forward + backward"):
            for method in methods:
                record = measure(method, mode, args, tokens)
                results[(tokens, mode, method)] = record
                print(f"| {tokens} | {mode} | {method} | {record['seconds']:.4g} | "
                      f"{record['extra'] / 2**20:.1f} MiB | {record['extra'] / record['logits']:.3f} |", flush=True)
    if not has_verl and {"unfused (torch ops)", "otb_torch fused", "matmul floor"} <= set(methods):
        print("\n## Without verl: otb_torch fused against the materialising baseline and the matmul floor\n")
        for tokens in token_counts:
            for mode in ("forward", "forward + backward"):
                ours, unfused = (results[(tokens, mode, name)] for name in ("otb_torch fused", "unfused (torch ops)"))
                floor = results[(tokens, mode, "matmul floor")]
                print(f"* N = {tokens}, {mode}: extra memory {ours['extra'] / ours['logits']:.3f}× the logits "
                      f"(unfused: {unfused['extra'] / unfused['logits']:.3f}×); time "
                      f"{ours['seconds'] / unfused['seconds']:.2f}× unfused, "
                      f"{ours['seconds'] / floor['seconds']:.2f}× the matmul floor")
    if not {"(a) verl unfused", "(b) verl FusedLinearForPPO", "otb_torch fused", "matmul floor"} <= set(methods):
        return
    print("\n## Targets (issue 23)\n")
    for tokens in token_counts:
        for mode in ("forward", "forward + backward"):
            ours = results[(tokens, mode, "otb_torch fused")]
            unfused = results[(tokens, mode, "(a) verl unfused")]
            fused = results[(tokens, mode, "(b) verl FusedLinearForPPO")]
            memory = ours["extra"] / ours["logits"]
            lines = [f"extra memory {memory:.3f}× the logits (target ≤ 0.1: {'met' if memory <= 0.1 else 'NOT met'})",
                     f"time {ours['seconds'] / unfused['seconds']:.2f}× path (a) (target ≤ 1: "
                     f"{'met' if ours['seconds'] <= unfused['seconds'] else 'NOT met'})"]
            if mode == "forward + backward":
                ratio = ours["seconds"] / fused["seconds"]
                floor = results[(tokens, mode, "matmul floor")]["seconds"]
                lines.append(f"time {ratio:.2f}× path (b) (target ≤ 0.6: {'met' if ratio <= 0.6 else 'NOT met'}; "
                             f"the matmul floor alone is {floor / fused['seconds']:.2f}× path (b), otb_torch is "
                             f"{ours['seconds'] / floor:.2f}× the floor)")
            print(f"* N = {tokens}, {mode}: " + "; ".join(lines))
    if len(token_counts) > 1:
        extras = [results[(n, "forward + backward", "otb_torch fused")]["extra"] for n in token_counts]
        print(f"* otb_torch fused, forward + backward: extra memory {', '.join(f'{e / 2**20:.1f}' for e in extras)} "
              f"MiB at N = {', '.join(map(str, token_counts))} — does not grow with N: "
              f"{'yes' if max(extras) <= 1.1 * min(extras) + 2**20 else 'NO'}")


if __name__ == "__main__":
    main()
