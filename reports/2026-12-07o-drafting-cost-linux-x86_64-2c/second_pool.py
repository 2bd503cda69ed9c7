import sys, time, threading, torch
from specula.runtime.bench.served import world_prompts, _load
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.engine.prompts import eos_ids
from specula.runtime.core.sampling import SamplingParams
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
if sys.argv[1] == "pool":
    def other():
        x = torch.ones(2_000_000); x.add_(1.0); print("other thread threads", torch.get_num_threads())
    th = threading.Thread(target=other); th.start(); th.join()
    keep = threading.Thread(target=lambda: time.sleep(1000), daemon=True)
elif sys.argv[1] == "pool_alive":
    ev = threading.Event()
    def other():
        x = torch.ones(2_000_000); x.add_(1.0); ev.wait()
    th = threading.Thread(target=other, daemon=True); th.start()
print("after", go(), go(), go())
