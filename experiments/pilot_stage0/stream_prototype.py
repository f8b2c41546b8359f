"""Prototype: streaming running-sum transducer."""
import sys, time, argparse, numpy as np, torch
from torch import nn
torch.set_num_threads(1)
import otb_torch
from otb_experiment import run as R
BOS = 10
class P(nn.Module):
    def __init__(s, embed=32, hidden=64, layers=2):
        super().__init__(); s.ey = nn.Embedding(11, embed); s.ed = nn.Embedding(10, embed)
        s.gru = nn.GRU(2*embed, hidden, num_layers=layers, batch_first=True); s.head = nn.Linear(hidden, 10)
    def forward(s, prev, digits, state=None):
        o, st = s.gru(torch.cat([s.ey(prev), s.ed(digits)], -1), state); return s.head(o), st
def make(rng, count, lo, hi):
    n = rng.integers(lo, hi+1, count); d = rng.integers(0, 10, (count, hi)); 
    mask = np.arange(hi)[None] < n[:, None]; d = np.where(mask, d, 0)
    return d, n
import os
KIND=os.environ.get("KIND","mod")
def target(d):
    s = np.cumsum(d, 1) % 10
    return s if KIND=="mod" else (s >= 5).astype(np.int64) if KIND=="bin" else s // 2
@torch.no_grad()
def decode(p, d, choose):
    B, L = d.shape; dt = torch.from_numpy(d); prev = torch.full((B,), BOS); st=None; out = torch.empty(B, L, dtype=torch.int64)
    for k in range(L):
        lg, st = p(prev[:, None], dt[:, k:k+1], st); y = choose(lg[:, 0]); out[:, k] = y; prev = y
    return out
def reward(d, n, y):
    ok = (y == target(d)) | (np.arange(d.shape[1])[None] >= n[:, None]); return ok.all(1).astype(float)
def tf_logits(p, d, y):
    prev = torch.cat([torch.full((y.shape[0], 1), BOS), y[:, :-1]], 1); return p(prev, torch.from_numpy(d))[0]
ap = argparse.ArgumentParser(); ap.add_argument("--lo", type=int, default=8); ap.add_argument("--hi", type=int, default=32)
ap.add_argument("--sft", type=int, default=200); ap.add_argument("--sftlr", type=float, default=3e-3); ap.add_argument("--hidden", type=int, default=64)
ap.add_argument("--lr", type=float, default=1e-3); ap.add_argument("--steps", type=int, default=200); ap.add_argument("--arm", default="gm32"); ap.add_argument("--eval", type=int, default=25)
ap.add_argument("--seed", type=int, default=100); ap.add_argument("--pps", type=int, default=16)
a = ap.parse_args()
rng = np.random.default_rng(a.seed); torch.manual_seed(a.seed)
test_d, test_n = make(rng, 4096, a.lo, a.hi)
p = P(hidden=a.hidden)
def ev():
    g = reward(test_d, test_n, decode(p, test_d, lambda l: l.argmax(-1)).numpy()).mean()
    gen = torch.Generator().manual_seed(5)
    s = reward(test_d, test_n, decode(p, test_d, lambda l: torch.multinomial(torch.softmax(l, -1), 1, generator=gen)[:, 0]).numpy()).mean()
    return g, s
opt = torch.optim.Adam(p.parameters(), lr=a.sftlr); t0=time.time()
for step in range(1, a.sft+1):
    d, n = make(rng, 64, a.lo, a.hi); y = torch.from_numpy(target(d)); m = torch.from_numpy(np.arange(a.hi)[None] < n[:, None]).float()
    lg = tf_logits(p, d, y); loss = (nn.functional.cross_entropy(lg.reshape(-1, 10), y.reshape(-1), reduction="none") * m.reshape(-1)).sum() / m.sum()
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 50 == 0: print("sft", step, f"loss {loss.item():.3f}", *(f"{x:.4f}" for x in ev()), f"t {time.time()-t0:.0f}", flush=True)
opt = torch.optim.Adam(p.parameters(), lr=a.lr); N = R.ARMS[a.arm][1]; gen = torch.Generator().manual_seed(1); tok = 0
print("rl start", *(f"{x:.4f}" for x in ev()), flush=True); rew=[]; gns=[]; ents=[]
for step in range(1, a.steps+1):
    d, n = make(rng, a.pps, a.lo, a.hi); d = np.repeat(d, N, 0); n = np.repeat(n, N); ids = np.repeat(np.arange(a.pps), N)
    y = decode(p, d, lambda l: torch.multinomial(torch.softmax(l, -1), 1, generator=gen)[:, 0])
    r = reward(d, n, y.numpy()); m = torch.from_numpy(np.arange(a.hi)[None] < n[:, None]).float()
    lg = tf_logits(p, d, y); st = otb_torch.token_statistics_from_logits(lg.detach(), y)
    rt = torch.zeros_like(m); rt[torch.arange(len(n)), torch.from_numpy(n-1)] = torch.from_numpy(r).float()
    adv = R.arm_advantages(a.arm, rt, m, ids, st.log_probs*m, st.sum_pi_squared*m + (1-m))
    lp = torch.log_softmax(lg, -1).gather(-1, y[..., None])[..., 0]
    loss = -(adv*lp*m).sum()/m.shape[0]; opt.zero_grad(); loss.backward()
    gns.append(float(torch.nn.utils.clip_grad_norm_(p.parameters(), float('inf')))); opt.step()
    tok += int(m.sum()); rew.append(r.mean()); ents.append(float((st.entropy*m).sum()/m.sum()))
    if step % a.eval == 0: print(step, tok, *(f"{x:.4f}" for x in ev()), f"rew {np.mean(rew[-a.eval:]):.3f} ent {np.mean(ents[-a.eval:]):.3f} gn {np.median(gns[-a.eval:]):.2f}/{max(gns[-a.eval:]):.2f} t {time.time()-t0:.0f}", flush=True)
