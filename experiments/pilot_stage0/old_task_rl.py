import sys, time, argparse, numpy as np, torch
torch.set_num_threads(1)
from otb_experiment import run as R, task
from otb_experiment.policy import Policy, sample
ap = argparse.ArgumentParser()
ap.add_argument("--seed", type=int, default=100); ap.add_argument("--warm"); ap.add_argument("--arm", default="gm32")
ap.add_argument("--lr", type=float, default=1e-3); ap.add_argument("--steps", type=int, default=300)
ap.add_argument("--eval", type=int, default=25); ap.add_argument("--clip", type=float, default=0)
ap.add_argument("--mind", type=int, default=4); ap.add_argument("--maxd", type=int, default=16); ap.add_argument("--hidden", type=int, default=64)
ap.add_argument("--pps", type=int, default=16); ap.add_argument("--update", default="pg"); ap.add_argument("--b2", type=float, default=0.999)
a = ap.parse_args()
L = 2*a.maxd+1
rng0 = np.random.default_rng([a.seed, 1])
train = task.make_prompts(rng0, 20000, a.mind, a.maxd); test = task.make_prompts(rng0, 4096, a.mind, a.maxd)
p = Policy(hidden=a.hidden); p.load_state_dict(torch.load(a.warm))
opt = torch.optim.Adam(p.parameters(), lr=a.lr, betas=(0.9, a.b2))
N = R.ARMS[a.arm][1]
g = torch.Generator().manual_seed(a.seed*7+1); rng = np.random.default_rng([a.seed, 5])
def ev():
    tg = R.accuracy(p, test, L)
    ro = sample(p, test, 1, torch.Generator().manual_seed(12345), L)
    ts = task.rewards_of(test, ro.tokens.numpy(), ro.lengths).mean()
    return tg, ts
tok=0; t0=time.time(); gn=[]; ent=[]; rew=[]
print("start", *(f"{x:.4f}" for x in ev()), flush=True)
orig_step = opt.step
for step in range(1, a.steps+1):
    pr = R._prompts_at(train, rng.integers(0, len(train.digits), a.pps))
    def hooked(*args, **kw):
        norm = torch.nn.utils.clip_grad_norm_(p.parameters(), a.clip if a.clip>0 else float('inf'))
        gn.append(float(norm)); return orig_step(*args, **kw)
    opt.step = hooked
    s = R.train_step(a.update, a.arm, p, opt, pr, N, g, L)
    tok += s["tokens"]; ent.append(s["entropy"]); rew.append(s["reward"])
    if step % a.eval == 0:
        tg, ts = ev()
        print(step, tok, f"greedy {tg:.4f} sampled {ts:.4f} reward {np.mean(rew[-a.eval:]):.3f} ent {np.mean(ent[-a.eval:]):.3f} gn med {np.median(gn[-a.eval:]):.2f} max {np.max(gn[-a.eval:]):.2f} t {time.time()-t0:.0f}", flush=True)
