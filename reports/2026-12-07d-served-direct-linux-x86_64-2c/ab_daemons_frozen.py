"""Served plain captions with and without the app's other Ray processes stopped (SIGSTOP) during each request,
against in-process plain: `python ab_daemons_frozen.py` (run at c990526)."""
import tempfile
import time, sys, os, signal, statistics as st
from pathlib import Path
import torch
torch.set_num_threads(2)
from specula.runtime.bench import served as S
from specula.runtime.config import load_config
cfg = load_config({})
target, processor = S._load(cfg.model.path)
ps = S.world_prompts(processor, ["caption"], 6)
inproc = S.in_process_runners(target, processor, {}, 0, 64)["plain"]
with S.ServedApp({"drafter": {"gamma": 0}, "grpc": {"enabled": False}}, num_cpus=None, log=Path(tempfile.gettempdir()) / "fd.log") as app:
    r = S.ServedRunner(app.url, 64, 1)
    pids = app.processes()
    rep = [p for p in pids if b"ServeReplica" in Path(f"/proc/{p}/cmdline").read_bytes()[:40]][0]
    others = [p for p in pids if p != rep]
    def frz(on):
        for p in others:
            try: os.kill(p, signal.SIGSTOP if on else signal.SIGCONT)
            except ProcessLookupError: pass
    res = {"inproc": [0, 0], "served": [0, 0], "served_daemons_frozen": [0, 0]}
    for p in ps[:2]: r.one(p); inproc([p])
    for rep_ in range(3):
        for p in ps:
            for name in res:
                if name == "inproc":
                    app.freeze(True); t0 = time.perf_counter(); o = inproc([p])[0]; w = time.perf_counter() - t0; app.freeze(False)
                else:
                    frz(name.endswith("frozen")); t0 = time.perf_counter(); o = r.one(p); w = time.perf_counter() - t0; frz(False)
                res[name][0] += w; res[name][1] += o["tokens"]
    for k, (w, n) in res.items(): print(k, f"{n/w:.1f} tok/s", f"{n/w/(res['inproc'][1]/res['inproc'][0]):.3f}")
