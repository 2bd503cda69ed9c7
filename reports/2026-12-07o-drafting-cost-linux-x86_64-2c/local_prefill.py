import sys, time, torch, uuid
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.config import load_config
from specula.runtime.serve.local import LocalApp
from specula.runtime.engine.compute_thread import compute_thread

cfg = load_config({"drafter": {"gamma": 0}, "deployments": {"vision_encoder": {"colocate": True}}})
app = LocalApp.from_config(cfg)
target, proc = compute_thread().call(_load, "target")
prompts = world_prompts(proc, ["caption"], 6)
eng = SpecEngine(target, None, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
def inproc():
    pre = 0.0; toks = 0; t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        r = next(iter(eng.generate([p.encoded.request(uuid.uuid4().hex, sp)]).values()))
        pre += r.metrics.time.get("prefill", 0); toks += len(r.tokens)
    return round(toks / (time.perf_counter() - t0), 1), round(1e3 * pre / len(prompts), 2)
def local():
    pre = 0.0; toks = 0; t0 = time.perf_counter()
    for p in prompts:
        out = app.openai("chat", {"model": "target", "messages": p.messages, "max_tokens": 64, "temperature": 0.0})
        m = out["specula"]["metrics"]; globals().setdefault("SHOWN", print(sorted(m)))
        pre += (m.get("time") or m.get("time_s") or {}).get("prefill", 0); toks += out["usage"]["completion_tokens"]
    return round(toks / (time.perf_counter() - t0), 1), round(1e3 * pre / len(prompts), 2)
from specula.runtime.engine.compute_thread import compute_thread
CT = compute_thread()
CT.call(torch.set_num_threads, 2)
CT.call(inproc); local()
for r in range(3):
    pass
    print("inproc tok/s, prefill ms/req", CT.call(inproc), "local", local())
