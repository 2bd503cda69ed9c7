import sys, json, torch
from pathlib import Path
from specula.runtime.bench.served import ServedApp, ServedRunner, world_prompts, _load, configs
torch.set_num_threads(2)
target, proc = _load("target")
prompts = world_prompts(proc, ["caption"], 6)
name = sys.argv[1] if len(sys.argv) > 1 else "default"
cfg = configs({})[name]
with ServedApp(cfg, num_cpus=None, log=Path(f"/tmp/exp/st-{name}.log")) as app:
    r = ServedRunner(app.url, 64, 1)
    r(prompts[:1])
    for rep in range(3):
        rows = [r([p])[0] for p in prompts]
        print(name, rep, [(round(q['metrics']['time_s']['prefill']*1e3, 1), round(q['wall_s']*1e3)) for q in rows], flush=True)
    r.close()
