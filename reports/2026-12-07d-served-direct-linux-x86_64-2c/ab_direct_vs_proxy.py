"""Ray 2.60's own direct ingress (RAY_SERVE_ENABLE_DIRECT_INGRESS=1) against Serve's proxy, the same apps:
`python ab_direct_vs_proxy.py caption 6` (run at b9219be, before http.direct existed)."""
import tempfile
import time, sys, os, subprocess, statistics as st, re, json
from pathlib import Path
os.environ["RAY_SERVE_ENABLE_DIRECT_INGRESS"] = "1"
import torch
torch.set_num_threads(2)
from specula.runtime.bench import served as S
from specula.runtime.config import load_config
cfg = load_config({})
target, processor = S._load(cfg.model.path)
suite = sys.argv[1].split(","); n = int(sys.argv[2])
prompts = S.world_prompts(processor, suite, n)
def replica_port(app):
    pids = app.processes()
    rep = [p for p in pids if b"ServeReplica" in Path(f"/proc/{p}/cmdline").read_bytes()[:40]][0]
    out = subprocess.run(["ss", "-ltnp"], capture_output=True, text=True).stdout
    for l in out.splitlines():
        if f"pid={rep}," in l and "127.0.0.1:3" in l: return int(re.search(r"127\.0\.0\.1:(\d+)", l).group(1))
apps = {}
try:
    for name, c in S.configs({}).items():
        apps[name] = S.ServedApp(c, num_cpus=None, log=Path(tempfile.gettempdir()) / f"ab-{name}.log")
    runners = {f"in_process/{k}": r for k, r in S.in_process_runners(target, processor, {"kind": cfg.drafter.kind, **cfg.drafter.options}, cfg.drafter.gamma, 64, cfg.drafter.adaptive, cfg.drafter.begin_after).items()}
    owner = {}
    for name, a in apps.items():
        runners[f"proxy/{name}"] = S.ServedRunner(a.url, 64, 1); owner[f"proxy/{name}"] = a
        port = replica_port(a); print(name, "replica port", port)
        runners[f"direct/{name}"] = S.ServedRunner(f"http://127.0.0.1:{port}/v1", 64, 1); owner[f"direct/{name}"] = a
    # freeze helper: the app of a runner stays up; others frozen
    sets = S.round_robin(runners, prompts, 1, {})
finally:
    for a in apps.values(): a.close()
tps = {k: sum(r["tokens"] for r in v["rows"]) / v["wall_s"] for k, v in sets.items()}
base = tps["in_process/plain"]
for k, v in tps.items(): print(f"{k:22s} {v:7.1f} tok/s  x in-proc plain {v/base:.3f}")
print("proxy default/plain", tps["proxy/default"]/tps["proxy/plain"], "direct default/plain", tps["direct/default"]/tps["direct/plain"])
