# alternate an env switch read at call time; per-propose ms and acceptance
import sys, time, torch, os, statistics as stt
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
st = {"t": 0.0, "n": 0}
orig = d.propose
def prop(*a, **k):
    t0 = time.perf_counter()
    try: return orig(*a, **k)
    finally: st["t"] += time.perf_counter() - t0; st["n"] += 1
d.propose = prop
n = [0]
def go():
    st["t"] = 0; st["n"] = 0; acc = 0; blocks = 0
    for p in prompts:
        n[0] += 1; r = eng.generate([p.encoded.request(f"r{n[0]}", sp)])
        m = next(iter(r.values())).metrics; acc += m.accepted_tokens; blocks += m.blocks
    return round(1e3 * st["t"] / st["n"], 3), round((acc + blocks) / blocks, 3)
var = sys.argv[2]
os.environ[var] = ""; go(); os.environ[var] = "1"; go()
res = {"off": [], "on": []}
for r in range(int(sys.argv[3]) if len(sys.argv) > 3 else 4):
    for v in ("off", "on"):
        os.environ[var] = "1" if v == "on" else ""
        res[v].append(go())
for k, v in res.items():
    print(k, v, "median ms", stt.median(x[0] for x in v))
