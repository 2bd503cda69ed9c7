import sys, time, torch
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.bench.spec import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
torch.set_num_threads(2)
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "reasoning"], 3)
d = make_drafter({"kind": sys.argv[1]}, target, proc.tokenizer)
eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
st = {"t": 0.0, "n": 0, "nt": 2}
orig = d.propose
def prop(*a, **k):
    t0 = time.perf_counter()
    if st["nt"] == 1: torch.set_num_threads(1)
    try: return orig(*a, **k)
    finally:
        if st["nt"] == 1: torch.set_num_threads(2)
        st["t"] += time.perf_counter() - t0; st["n"] += 1
d.propose = prop
n = [0]
def go():
    st["t"] = 0; st["n"] = 0; t0 = time.perf_counter()
    for p in prompts:
        n[0] += 1; eng.generate([p.encoded.request(f"r{n[0]}", sp)])
    return round(1e3 * st["t"] / st["n"], 3), round(time.perf_counter() - t0, 3)
go()
for r in range(3):
    for nt in (2, 1):
        st["nt"] = nt; print(nt, go())
