import sys, time, statistics, cProfile, pstats
import torch
from specula.runtime.config import load_config
from specula.runtime.bench.served import _load, world_prompts, in_process_runners
torch.set_num_threads(2)
cfg = load_config({})
drafter = {"kind": cfg.drafter.kind, **cfg.drafter.options}
print(drafter, cfg.drafter.gamma, cfg.drafter.adaptive, cfg.drafter.begin_after)
target, processor = _load(cfg.model.path)
suites = sys.argv[1].split(",")
prompts = world_prompts(processor, suites, 8, 0)
runners = in_process_runners(target, processor, drafter, cfg.drafter.gamma, 64, cfg.drafter.adaptive, cfg.drafter.begin_after)
for n, r in runners.items(): r(prompts[:1])
reps = int(sys.argv[2]) if len(sys.argv) > 2 else 3
T = {n: {} for n in runners}
for rep in range(reps):
    for i, p in enumerate(prompts):
        order = list(runners) if (i + rep) % 2 == 0 else list(runners)[::-1]
        for n in order:
            t0 = time.perf_counter(); rows = runners[n]([p]); w = time.perf_counter() - t0
            T[n].setdefault(p.suite, []).append((w, rows[0]["tokens"]))
for s in suites:
    a = T["plain"][s]; b = T["default"][s]
    wa = sum(w for w, _ in a); wb = sum(w for w, _ in b)
    print(s, "tokens", sum(t for _, t in a), sum(t for _, t in b), "plain ms/req %.2f default %.2f ratio(plain/default) %.4f" % (1000*wa/len(a), 1000*wb/len(b), wa/wb))
if len(sys.argv) > 3:
    for n in runners:
        pr = cProfile.Profile(); pr.enable()
        for p in prompts: runners[n]([p])
        pr.disable(); st = pstats.Stats(pr); st.sort_stats("cumulative").print_stats(25)
