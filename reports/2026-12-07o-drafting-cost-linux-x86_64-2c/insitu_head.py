import sys, time, torch, collections
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.bench.spec import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
torch.set_num_threads(2)
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "reasoning"], 3)
d = make_drafter({"kind": "text_lm"}, target, proc.tokenizer)
eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
acc = collections.defaultdict(lambda: [0.0, 0]); idx = [0]
h = d._head
print(type(h))
def head(x):
    t0 = time.perf_counter(); r = h(x); e = acc[idx[0]]; e[0] += time.perf_counter() - t0; e[1] += 1; idx[0] += 1; return r
d._head = head
orig_p = d.propose
def prop(*a, **k):
    idx[0] = 0; return orig_p(*a, **k)
d.propose = prop
n = [0]
def go():
    for p in prompts:
        n[0] += 1; eng.generate([p.encoded.request(f"r{n[0]}", sp)])
go()
for r in range(2):
    acc.clear(); go()
    print({k: round(1e6 * v[0] / v[1], 1) for k, v in sorted(acc.items())})
