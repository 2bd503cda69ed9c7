import time, torch, uuid, sys
torch.set_num_threads(2)
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "vqa", "chart"], 3)
eng = SpecEngine(target, None, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=1, temperature=0.0)
def run():
    pre = 0.0
    for p in prompts:
        r = next(iter(eng.generate([p.encoded.request(uuid.uuid4().hex, sp)]).values()))
        pre += r.metrics.time.get("prefill", 0)
    return pre / len(prompts)
for _ in range(3): run()
ts = [run() for _ in range(5)]
print("prefill ms/req", [round(t*1e3, 2) for t in ts], "lens", [len(p.encoded.input_ids) if hasattr(p.encoded,'input_ids') else None for p in prompts][:3])
from torch.profiler import profile, ProfilerActivity
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(3): run()
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=35))
