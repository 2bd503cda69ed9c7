import time, torch, threading, sys
from specula.runtime.bench.served import world_prompts, _load, in_process_runners
from specula.runtime.engine.compute_thread import compute_thread
CT = compute_thread(); CT.call(torch.set_num_threads, 2)
target, proc = CT.call(_load, "target")
prompts = CT.call(world_prompts, proc, ["caption"], 6)
rs = CT.call(lambda: in_process_runners(target, proc, {"kind": "flash", "path": "flash"}, 8, 64, adaptive=True, begin_after=2))
period = float(sys.argv[1]) if len(sys.argv) > 1 else 0.01
on = threading.Event()
def ticker():
    while True:
        on.wait()
        time.sleep(period)
if period > 0: threading.Thread(target=ticker, daemon=True).start()
for name in rs:
    for p in prompts: CT.call(rs[name], [p])
res = {}
for rnd in range(4):
    for tick in (False, True):
        (on.set if tick else on.clear)()
        for name in rs:
            tok = wall = 0
            for _ in range(2):
                for p in prompts:
                    x = CT.call(rs[name], [p])[0]; tok += x["tokens"]; wall += x["wall_s"]
            res.setdefault((name, tick), []).append(round(tok / wall, 1))
for k, v in res.items(): print(k, v)
