import sys, time, torch, cProfile, pstats
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
n = [0]
def go():
    for p in prompts:
        n[0] += 1; eng.generate([p.encoded.request(f"r{n[0]}", sp)])
go()
pr = cProfile.Profile(); pr.enable(); go(); go(); pr.disable()
st = pstats.Stats(pr); st.sort_stats("cumulative")
st.print_callees(sys.argv[2])
