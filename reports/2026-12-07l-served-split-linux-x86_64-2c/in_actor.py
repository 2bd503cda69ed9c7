import os, time, sys
os.environ.setdefault("RAY_AUTH_MODE", "disabled"); os.environ["RAY_worker_niceness"] = "0"
import ray, torch
def bench(rounds=3):
    import torch, time
    from specula.runtime.bench.served import world_prompts, _load, in_process_runners
    from specula.runtime.engine.compute_thread import compute_thread
    CT = compute_thread(); CT.call(torch.set_num_threads, 2)
    target, proc = CT.call(_load, "target")
    prompts = CT.call(world_prompts, proc, ["caption"], 6)
    rs = CT.call(lambda: in_process_runners(target, proc, {"kind": "flash", "path": "flash"}, 8, 64, adaptive=True, begin_after=2))
    for name in rs:
        for p in prompts: CT.call(rs[name], [p])
    out = {}
    for rnd in range(rounds):
        for name in rs:
            tok = wall = 0
            for p in prompts:
                x = CT.call(rs[name], [p])[0]; tok += x["tokens"]; wall += x["wall_s"]
            out.setdefault(name, []).append(round(tok / wall, 1))
    return out
@ray.remote(num_cpus=2)
class A:
    def run(self, rounds): return bench(rounds)
ray.init(num_cpus=2, include_dashboard=False, _temp_dir="/tmp/ray-in-actor", log_to_driver=False)
a = A.remote(); ray.get(a.run.remote(1))
for i in range(2):
    print("actor ", ray.get(a.run.remote(3)))
    print("driver", bench(3))
ray.shutdown()
