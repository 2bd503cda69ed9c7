import sys, time, torch
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.bench.spec import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
torch.set_num_threads(2)
kind = sys.argv[1]
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "reasoning"], 3)
d = make_drafter({"kind": kind}, target, proc.tokenizer)
eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
n = [0]
def go():
    for p in prompts:
        n[0] += 1; eng.generate([p.encoded.request(f"r{n[0]}", sp)])
go()
import cProfile, pstats
from torch.profiler import profile, ProfilerActivity
orig = d.propose
stats = {"t": 0.0, "n": 0}
def timed(*a, **k):
    t0 = time.perf_counter()
    with torch.profiler.record_function("PROPOSE"): r = orig(*a, **k); stats["t"] += time.perf_counter() - t0; stats["n"] += 1; return r
d.propose = timed
go(); print(kind, "propose ms/block", round(1e3 * stats["t"] / stats["n"], 3), "blocks", stats["n"])
with profile(activities=[ProfilerActivity.CPU]) as prof:
    stats["n"] = 0
    go()
nb = stats["n"]
ka = prof.key_averages()
print("blocks", nb)
import collections
ev = prof.events()
spans = sorted((e.time_range.start, e.time_range.end) for e in ev if e.name == "PROPOSE")
import bisect
starts = [a for a, b in spans]
agg = collections.defaultdict(lambda: [0.0, 0])
for e in ev:
    if e.name == "PROPOSE": continue
    i = bisect.bisect_right(starts, e.time_range.start) - 1
    if i >= 0 and e.time_range.end <= spans[i][1]:
        agg[e.name][0] += e.self_cpu_time_total; agg[e.name][1] += 1
tot = sum(v[0] for v in agg.values())
print("inside propose: self us per block", round(tot / nb, 1), "ops per block", round(sum(v[1] for v in agg.values()) / nb, 1))
for k, v in sorted(agg.items(), key=lambda kv: -kv[1][0])[:25]:
    print(f"{v[0]/nb:8.1f} us/block {v[1]/nb:6.1f} calls/block  {k}")
