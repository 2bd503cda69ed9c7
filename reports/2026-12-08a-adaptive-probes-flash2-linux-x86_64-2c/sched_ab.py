"""SCHED_IDLE for every thread of the served app but the replica's compute threads, alternating on one app."""
import os, sys, time
from pathlib import Path
from specula.runtime.bench.served import ServedApp, ServedRunner, world_prompts, configs
from specula.targets.processor import load_processor
from specula.zoo.store import resolve
proc = load_processor(resolve("target"))
name = sys.argv[1] if len(sys.argv) > 1 else "plain"
suites = (sys.argv[2] if len(sys.argv) > 2 else "caption").split(",")
prompts = world_prompts(proc, suites, 6)
cfg = configs({"grpc": {"enabled": False}})[name]
def tasks(pids):
    out = {}
    for p in pids:
        try:
            for t in os.listdir(f"/proc/{p}/task"):
                s = Path(f"/proc/{p}/task/{t}/stat").read_text(); f = s.rsplit(")", 1)[1].split()
                out[(p, int(t))] = int(f[11]) + int(f[12])
        except OSError: pass
    return out
with ServedApp(cfg, num_cpus=None, log=Path("/tmp/serve-s.log")) as app:
    r = ServedRunner(app.url, 64, 1)
    for p in prompts: r([p])
    pids = app.processes()
    rep = [p for p in pids if "Ingress" in Path(f"/proc/{p}/cmdline").read_text()][0]
    t = tasks([rep]); hot = sorted(t, key=lambda k: -t[k])[:2]
    print("hot threads", hot, "pids", pids)
    def setpol(idle):
        n = 0
        for (p, tid) in tasks(pids):
            if (p, tid) in hot: continue
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0)); n += 1
            except OSError as e: pass
        return n
    def measure():
        tok = 0; t0 = time.perf_counter()
        for _ in range(2):
            for p in prompts: tok += r([p])[0]["tokens"]
        return tok / (time.perf_counter() - t0)
    res = {"other": [], "idle": []}
    for rnd in range(4):
        for v in ("other", "idle"):
            n = setpol(v == "idle"); res[v].append(round(measure(), 1))
    print(name, suites, "threads set", n, "SCHED_OTHER", res["other"], "SCHED_IDLE", res["idle"])
    setpol(False)
    r.close()
