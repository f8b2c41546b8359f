import sys, time, numpy as np, torch
torch.set_num_threads(1)
from otb_experiment import run as R, task
from otb_experiment.policy import Policy, Rollouts, teacher_forced
seed = int(sys.argv[1]); mind, maxd = int(sys.argv[2]), int(sys.argv[3]); hidden=int(sys.argv[4]); steps=int(sys.argv[5]); lr=float(sys.argv[6])
L = 2*maxd+1
rng0 = np.random.default_rng([seed, 1])
train = task.make_prompts(rng0, 20000, mind, maxd); test = task.make_prompts(rng0, 4096, mind, maxd)
torch.manual_seed(seed)
policy = Policy(hidden=hidden)
opt = torch.optim.Adam(policy.parameters(), lr=lr)
rng = np.random.default_rng([seed, 2])
t0=time.time()
for step in range(1, steps+1):
    rows = rng.integers(0, len(train.digits), 64)
    prompts = R._prompts_at(train, rows)
    answers = task.targets(prompts)
    tokens = torch.full((len(rows), L), task.PAD, dtype=torch.int64)
    for row, a in enumerate(answers): tokens[row, :len(a)] = torch.from_numpy(a)
    lengths = np.array([len(a) for a in answers])
    mask = (torch.arange(L)[None, :] < torch.from_numpy(lengths)[:, None]).float()
    logits = teacher_forced(policy, prompts, Rollouts(tokens, mask, lengths, np.arange(len(rows))))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, task.VOCAB), tokens.reshape(-1), reduction="none")
    loss = (loss * mask.reshape(-1)).sum() / mask.sum()
    opt.zero_grad(); loss.backward(); opt.step()
    if step % 100 == 0:
        acc = R.accuracy(policy, test, L)
        print(step, round(time.time()-t0,1), f"loss {loss.item():.3f} acc {acc:.4f}", flush=True)
        torch.save(policy.state_dict(), f"/tmp/pilot/sft-s{seed}-d{mind}-{maxd}-h{hidden}-{step}.pt")
