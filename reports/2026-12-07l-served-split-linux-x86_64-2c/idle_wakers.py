"""Wake-ups of every thread on the machine over 5 s while an idle `specula serve` (plain config) runs.
Usage (from the repository root): .venv/bin/python reports/2026-12-07l-served-split-linux-x86_64-2c/idle_wakers.py
[RAY_name=value ...]  (extra environment for the served app's Ray)."""
import os
import sys
import time
from pathlib import Path

from specula.runtime.bench.served import ServedApp, configs


def allthreads():
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{p}/cmdline").read_text().replace("\0", " ")[:60]
            for t in os.listdir(f"/proc/{p}/task"):
                st = Path(f"/proc/{p}/task/{t}/status").read_text().splitlines()
                g = lambda k: int([l for l in st if l.startswith(k)][0].split()[1])  # noqa: E731
                name = [l for l in st if l.startswith("Name")][0].split(None, 1)[1]
                f = Path(f"/proc/{p}/task/{t}/stat").read_text().rsplit(")", 1)[1].split()
                out[(p, t)] = (cmd, name, g("voluntary_ctxt"), g("nonvoluntary_ctxt"), int(f[11]) + int(f[12]))
        except (OSError, IndexError):
            pass
    return out


os.environ.update(dict(a.split("=", 1) for a in sys.argv[1:]))
with ServedApp(configs({"grpc": {"enabled": False}})["plain"], num_cpus=None, log=Path("/tmp/serve-idle.log")):
    time.sleep(5)
    a = allthreads()
    time.sleep(5)
    b = allthreads()
    rows = []
    for k, (cmd, name, v, nv, c) in b.items():
        o = a.get(k, (cmd, name, 0, 0, 0))
        rows.append((v - o[2], nv - o[3], c - o[4], k, name, cmd))
    rows.sort(key=lambda x: -(x[0] + x[1]))
    print("idle 5 s: total wakeups", sum(x[0] + x[1] for x in rows), "cpu ticks", sum(x[2] for x in rows))
    for v, nv, c, k, name, cmd in rows[:25]:
        print(f"vol {v:6d} nonvol {nv:5d} cpu {c:4d}t {k[0]:>7}/{k[1]:<7} {name:18s} {cmd}")
