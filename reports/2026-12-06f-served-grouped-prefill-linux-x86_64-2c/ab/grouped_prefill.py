"""In-process A/B of the target's grouped prefill at 8 streams: plain and the default config, batches of 8 world
prompts (every suite), grouped (this commit) vs one padded prefill (length_groups forced to one group), rounds
alternating. Usage: python grouped_prefill.py ROUNDS"""
import sys, time, random, torch
from specula.runtime.config import load_config
from specula.runtime.bench import served
from specula.targets import hf_target
torch.set_num_threads(2)
cfg = load_config({"grpc": {"enabled": False}})
drafter = {"kind": cfg.drafter.kind, **cfg.drafter.options}
target, processor = served._load(cfg.model.path)
prompts = served.world_prompts(processor, served.SUITES, 4)
random.Random(0).shuffle(prompts)  # arrivals of every kind, as served streams see them
runners = served.in_process_runners(target, processor, drafter, cfg.drafter.gamma, 64, cfg.drafter.adaptive,
                                    cfg.drafter.begin_after)
grouped = hf_target.length_groups
one = lambda lengths: [list(range(len(lengths)))] if lengths else []
batches = [prompts[i:i + 8] for i in range(0, len(prompts), 8)]
for r in runners.values():
    r(prompts[:2])
tot = {}
for rnd in range(int(sys.argv[1])):
    for arm in (("grouped", "one") if rnd % 2 == 0 else ("one", "grouped")):
        hf_target.length_groups = grouped if arm == "grouped" else one
        for name, r in runners.items():
            t0 = time.perf_counter(); toks = sum(x["tokens"] for b in batches for x in r(b))
            tot.setdefault((name, arm), []).append(toks / (time.perf_counter() - t0))
for name in runners:
    g, o = tot[(name, "grouped")], tot[(name, "one")]
    print(f"{name}: grouped {['%.1f' % x for x in g]} one {['%.1f' % x for x in o]} tokens/s; ratio "
          f"{sum(g) / sum(o):.3f}")
