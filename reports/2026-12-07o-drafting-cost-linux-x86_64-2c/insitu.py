import sys, time, torch, collections
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.bench.spec import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
from specula.drafters import lean_llama
torch.set_num_threads(2)
kind = sys.argv[1]
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "reasoning"], 3)
d = make_drafter({"kind": kind}, target, proc.tokenizer)
eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
acc = collections.defaultdict(lambda: [0.0, 0]); idx = [0]
orig_layer = lean_llama.decoder_layer
def lay(*a, **k):
    t0 = time.perf_counter(); r = orig_layer(*a, **k); e = acc[(idx[0], a[6])]; e[0] += time.perf_counter() - t0; e[1] += 1; return r
lean_llama.decoder_layer = lay
orig_fwd = d._forward
def fwd(*a, **k):
    r = orig_fwd(*a, **k); idx[0] += 1; return r
d._forward = fwd
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
    print({f"s{k[0]}l{k[1]}": round(1e6 * v[0] / v[1], 1) for k, v in sorted(acc.items())})
