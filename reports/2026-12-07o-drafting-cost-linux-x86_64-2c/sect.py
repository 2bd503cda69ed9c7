import sys, time, torch, collections
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.bench.spec import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
from specula.drafters import lean_llama, text_lm
torch.set_num_threads(2)
kind = sys.argv[1]
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "reasoning"], 3)
d = make_drafter({"kind": kind}, target, proc.tokenizer)
eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
acc = collections.defaultdict(float)
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t0 = time.perf_counter(); r = f(*a, **k); acc[label] += time.perf_counter() - t0; return r
    setattr(obj, name, g)
for name in sys.argv[2:]:
    mod, attr = name.split(":")
    obj = {"d": d, "lean": lean_llama, "tl": text_lm, "kv": getattr(d, "_kv", None), "head": getattr(d, "_head", None)}[mod]
    wrap(obj, attr, name)
wrap(d, "propose", "propose")
n = [0]
def go():
    for p in prompts:
        n[0] += 1; eng.generate([p.encoded.request(f"r{n[0]}", sp)])
go()
for r in range(3):
    acc.clear(); nb0 = 0
    cnt = collections.Counter()
    orig = d.propose
    def c(*a, **k):
        cnt["n"] += 1; return orig(*a, **k)
    d.propose = c
    go()
    d.propose = orig
    print({k: round(1e3 * v / cnt["n"], 3) for k, v in acc.items()}, "blocks", cnt["n"])
