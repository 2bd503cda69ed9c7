import time, torch, statistics
from pathlib import Path
from specula.runtime.bench.served import world_prompts, _load, in_process_runners, ServedApp, configs
from specula.runtime.engine.compute_thread import compute_thread
CT = compute_thread(); CT.call(torch.set_num_threads, 2)
target, proc = CT.call(_load, "target")
prompts = CT.call(world_prompts, proc, ["caption"], 6)
rs = CT.call(lambda: in_process_runners(target, proc, {"kind": "flash", "path": "flash"}, 8, 64, adaptive=True, begin_after=2))
with ServedApp(configs({"grpc": {"enabled": False}})["plain"], num_cpus=None, log=Path("/tmp/serve-b.log")) as app:
    for name in rs:
        for p in prompts: CT.call(rs[name], [p])
    res = {}
    for rnd in range(3):
        for frozen in (True, False):
            app.freeze(frozen); time.sleep(0.5)
            for name in rs:
                tok = wall = 0
                for _ in range(2):
                    for p in prompts:
                        x = CT.call(rs[name], [p])[0]; tok += x["tokens"]; wall += x["wall_s"]
                res.setdefault((name, frozen), []).append(round(tok / wall, 1))
    app.freeze(False)
    for k, v in res.items(): print(k, v)
