"""Wall time at the client against the time the verifier booked, one-token and 64-token captions, served plain:
`python hop.py` (run at b9219be)."""
import tempfile
import json, time, sys, statistics as st, os, subprocess
from pathlib import Path
import torch
torch.set_num_threads(2)
from specula.runtime.bench.served import ServedApp, ServedRunner, world_prompts, in_process_runners
from specula.runtime.config import load_config
from specula.runtime.engine.factory import load_processor_for
import requests as httpx
cfg = load_config({})
proc = load_processor_for(cfg)
ps = world_prompts(proc, ["caption"], 6)
prof = len(sys.argv) > 1
with ServedApp({"drafter": {"gamma": 0}}, num_cpus=None, log=Path(tempfile.gettempdir()) / "hop_serve.log") as app:
    r = ServedRunner(app.url, 64, 1)
    c = httpx.Session()
    for _ in range(5): c.get(app.url + "/models")
    t = []
    for _ in range(50):
        t0 = time.perf_counter(); c.get(app.url + "/models"); t.append(time.perf_counter() - t0)
    print(f"GET /models median {1e3*st.median(t):.2f} ms")
    for mt in (1, 64):
        r.max_tokens = mt
        for p in ps[:2]: r.one(p)
        walls = []; books = []
        for rep in range(2):
            for p in ps:
                o = r.one(p); walls.append(o["wall_s"]); m = o["metrics"]
                pass
        print(f"served max_tokens {mt}: wall median {1e3*st.median(walls):.1f} ms; metrics keys {sorted(m)[:20]}")
        print("  metrics", {k: round(v, 4) if isinstance(v, float) else v for k, v in m.items()})
