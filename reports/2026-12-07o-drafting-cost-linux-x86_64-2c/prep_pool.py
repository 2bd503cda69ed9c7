import sys, time, threading, concurrent.futures, torch, uuid
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
from specula.runtime.config import load_config
from specula.runtime.serve.ingress import IngressEngine
from specula.runtime.serve.openai_api import OpenAIApi
torch.set_num_threads(2)
target, proc = _load("target")
prompts = world_prompts(proc, ["caption"], 6)
eng = SpecEngine(target, None, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=64, temperature=0.0)
n = [0]
def go():
    t0 = time.perf_counter(); toks = 0
    for p in prompts:
        n[0] += 1; r = eng.generate([p.encoded.request(f"r{n[0]}", sp)]); toks += sum(len(x.tokens) for x in r.values())
    return round(toks / (time.perf_counter() - t0), 1)
go()
print("before", go(), go())
cfg = load_config({})
ing = IngressEngine.from_config(cfg)
api = OpenAIApi(ing)
ex = concurrent.futures.ThreadPoolExecutor(1)
def prep(p):
    plan = api.parse("chat", {"model": "target", "messages": p.messages, "max_tokens": 64})
    return api.prepare(plan, uuid.uuid4().hex)
req = ex.submit(prep, prompts[0]).result()
print("prepared", type(req).__name__, None if req.pixel_values is None else (req.pixel_values.shape, req.pixel_values.dtype))
print("after", go(), go(), go())
import os
print("threads", len(os.listdir("/proc/self/task")))
ex2 = concurrent.futures.ThreadPoolExecutor(1)
ex2.submit(lambda: torch.ones(2_000_000).add_(1.0)).result()
print("threads after parallel op in a kept thread", len(os.listdir("/proc/self/task")))
print("after2", go(), go())
