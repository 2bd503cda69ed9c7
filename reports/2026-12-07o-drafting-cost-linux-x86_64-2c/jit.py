import time, torch
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
torch.set_num_threads(2)
target, proc = _load("target")
prompts = world_prompts(proc, ["caption", "vqa", "reasoning", "chart"], 4)
eng = SpecEngine(target, None, eos_token_ids=eos_ids(proc.tokenizer, target))
sp = SamplingParams(max_tokens=1, temperature=0.0)
n = [0]
def pf(p):
    n[0] += 1
    r = next(iter(eng.generate([p.encoded.request(f"r{n[0]}", sp)]).values()))
    return round(1e3 * r.metrics.time["prefill"], 1)
seen = set()
for p in prompts:
    L = p.encoded.input_ids.numel()
    print(p.prompt_id, L, "new" if L not in seen else "seen", pf(p), pf(p), pf(p))
    seen.add(L)
