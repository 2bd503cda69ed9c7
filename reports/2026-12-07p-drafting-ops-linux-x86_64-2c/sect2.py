import sys, time, torch, collections
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.bench.spec import make_drafter
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
from specula.drafters import lean_llama as LL
torch.set_num_threads(2)
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "reasoning"], 3)
d = make_drafter({"kind": sys.argv[1]}, target, proc.tokenizer)
eng = SpecEngine(target, d, gamma=5, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
T = collections.defaultdict(float); N = collections.defaultdict(int)
def wrap(owner, name, key):
    f = getattr(owner, name)
    def g(*a, **k):
        t0 = time.perf_counter()
        try: return f(*a, **k)
        finally: T[key] += time.perf_counter() - t0; N[key] += 1
    setattr(owner, name, g)
cls = type(d)
wrap(d, "propose", "propose")
for nm in ["_feed_tail", "_forward", "_children", "_draw_chain"]:
    wrap(d, nm, nm)
wrap(d, "_head", "_head")
wrap(LL, "model_forward", "model_forward")
wrap(LL, "decoder_layer", "decoder_layer")
wrap(LL, "rope_tables", "rope_tables")
n = [0]
def go():
    for p in prompts:
        n[0] += 1; eng.generate([p.encoded.request(f"r{n[0]}", sp)])
go(); T.clear(); N.clear()
for _ in range(3): go()
P = N["propose"]
for k in T: print(f"{k:15s} us/propose {1e6*T[k]/P:8.1f}  calls/propose {N[k]/P:.1f}")
# per-width forward time
W = collections.defaultdict(list)
f0 = LL.model_forward
def mf(body, mask, pos, cache, input_ids=None, inputs_embeds=None, int8=False):
    t0 = time.perf_counter()
    try: return f0(body, mask, pos, cache, input_ids=input_ids, inputs_embeds=inputs_embeds, int8=int8)
    finally: W[pos.shape[1]].append(time.perf_counter() - t0)
LL.model_forward = mf
T.clear(); N.clear()
go()
for w in sorted(W): print("width", w, "n", len(W[w]), "us", round(1e6 * sum(W[w]) / len(W[w]), 1))
print("feed_tail us/call", round(1e6 * T["_feed_tail"] / N["_feed_tail"], 1))
