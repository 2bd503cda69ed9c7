import sys, time, torch
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.bench.spec import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
from specula.targets.packed_linear import pack_linears, unpack_linears
torch.set_num_threads(2)
kind = sys.argv[1]
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "reasoning"], 3)
d = make_drafter({"kind": kind}, target, proc.tokenizer)
eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
mods = [m for m in vars(d).values() if isinstance(m, torch.nn.Module)]
print("modules", [type(m).__name__ for m in mods])
n = [0]
stats = {"t": 0.0, "n": 0}
orig = d.propose
def timed(*a, **k):
    t0 = time.perf_counter(); r = orig(*a, **k); stats["t"] += time.perf_counter() - t0; stats["n"] += 1; return r
d.propose = timed
def go():
    stats["t"] = 0; stats["n"] = 0; t0 = time.perf_counter()
    for p in prompts:
        n[0] += 1; eng.generate([p.encoded.request(f"r{n[0]}", sp)])
    return 1e3 * stats["t"] / stats["n"], time.perf_counter() - t0
go()
for rnd in range(3):
    for packed in (False, True):
        for m in mods:
            (pack_linears if packed else unpack_linears)(m)
        ms, wall = go()
        print("packed" if packed else "stock ", round(ms, 3), "ms/block", round(wall, 3), "s")
