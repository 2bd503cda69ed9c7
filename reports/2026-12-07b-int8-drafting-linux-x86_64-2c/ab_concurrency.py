import time, sys, torch
from specula.runtime.bench.spec import load, make_drafter, eos_ids, encoded_prompts
from specula.runtime.engine.loop import SpecEngine
from specula.runtime.core.sampling import SamplingParams as SP
torch.set_num_threads(2)
_, processor, target, _ = load("target", hf=False)
tok = processor.tokenizer
eos = eos_ids(tok, target)
d = make_drafter({"kind": "flash"}, target, tok)
engines = {"plain": SpecEngine(target, None, eos_token_ids=eos)}
for g in (4, 8):
    engines[f"flash@{g}"] = SpecEngine(target, d, gamma=g, eos_token_ids=eos, adaptive=True, begin_after=2)
prompts = encoded_prompts(processor, ["caption", "vqa", "reasoning", "chart", "ocr", "multi_image", "video", "text"], 4, 0)
params = SP(temperature=0.0, max_tokens=64)
conc = int(sys.argv[1])
T = {k: 0.0 for k in engines}; N = {k: 0 for k in engines}
for rep in range(2):
    for i in range(0, len(prompts), conc):
        chunk = prompts[i:i + conc]
        for name, eng in engines.items():
            reqs = [p.request(f"{pid}-{name}-{rep}", params) for _, pid, p in chunk]
            t0 = time.perf_counter(); res = eng.generate(reqs); dt = time.perf_counter() - t0
            if rep: T[name] += dt; N[name] += sum(len(r.tokens) for r in res.values())
for k in engines: print(conc, k, f"{N[k]/T[k]:.1f} tokens/s  x plain {T['plain']/T[k]*N[k]/N['plain']:.3f}")
