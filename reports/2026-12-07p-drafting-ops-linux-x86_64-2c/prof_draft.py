import sys, time, torch, collections
from torch.profiler import profile, record_function, ProfilerActivity
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.bench.spec import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
torch.set_num_threads(2)
target, proc = _load("target")
prompts = world_prompts(proc, ["caption"], 3)
d = make_drafter({"kind": sys.argv[1]}, target, proc.tokenizer)
eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
import specula.drafters.lean_llama as LL
orig_mf = LL.model_forward
def mf(*a, **k):
    with record_function("MODEL"): return orig_mf(*a, **k)
LL.model_forward = mf
orig_head = type(d)._forward if hasattr(type(d), "_forward") else None
origp = d.propose
st = {"t": 0.0, "n": 0}
def prop(*a, **k):
    t0 = time.perf_counter()
    with record_function("PROPOSE"):
        try: return origp(*a, **k)
        finally: st["t"] += time.perf_counter() - t0; st["n"] += 1
d.propose = prop
n = [0]
def go():
    for p in prompts:
        n[0] += 1; eng.generate([p.encoded.request(f"r{n[0]}", sp)])
for _ in range(2): go()
st["t"] = 0; st["n"] = 0
for _ in range(3): go()
print("ms per propose (no profiler)", round(1e3 * st["t"] / st["n"], 3), st["n"])
with profile(activities=[ProfilerActivity.CPU]) as prof:
    go()
ev = prof.events()
# build containment by time on the same thread
props = [e for e in ev if e.name == "PROPOSE"]
models = [e for e in ev if e.name == "MODEL"]
ops = [e for e in ev if e.name.startswith("aten::") or e.name.startswith("mkldnn") or e.name.startswith("quantized")]
def inside(e, spans):
    s = e.time_range.start
    for sp_ in spans:
        if sp_.time_range.start <= s <= sp_.time_range.end: return True
    return False
# top-level ops only: those whose parent is not an aten op
top = [e for e in ops if e.cpu_parent is None or not (e.cpu_parent.name.startswith("aten::") or e.cpu_parent.name.startswith("mkldnn"))]
inprop = [e for e in top if inside(e, props)]
inmodel = [e for e in inprop if inside(e, models)]
print("proposes", len(props), "top ops per propose", len(inprop) / len(props), "in model", len(inmodel) / len(props))
c = collections.Counter(e.name for e in inprop if not inside(e, models))
print("outside model per propose:", [(k, round(v / len(props), 1)) for k, v in c.most_common(40)])
c2 = collections.Counter(e.name for e in inmodel)
print("in model per propose:", [(k, round(v / len(props), 1)) for k, v in c2.most_common(40)])
tp = sum(e.time_range.elapsed_us() for e in props) / len(props)
tm_ = sum(e.time_range.elapsed_us() for e in models) / len(props)
print("profiled us per propose", round(tp), "in model", round(tm_))
heads = {}
