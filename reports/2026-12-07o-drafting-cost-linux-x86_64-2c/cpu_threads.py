import subprocess, time, sys, os
from pathlib import Path
from specula.runtime.bench import served as S
from specula.runtime.bench.served import world_prompts, _load, ServedApp
_, proc = _load("target")
prompts = world_prompts(proc, ["caption"], 6)
app = ServedApp({"drafter": {"gamma": 0}}, num_cpus=None, log=Path("/tmp/exp/cpu_serve.log"))
def snap(pid):
    out = {}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            st = open(f"/proc/{pid}/task/{t}/stat").read()
            name = st[st.index("(") + 1: st.rindex(")")]
            f = st.rsplit(")", 1)[1].split()
            out[int(t)] = (name, int(f[11]) + int(f[12]), int(f[19 - 2 + 0]) if False else 0)
        except OSError:
            pass
    return out
try:
    runner = S.ServedRunner(app.url, 64, 1)
    for p in prompts[:2]: runner.one(p)
    pid = [p for p in app.processes() if "Ingress" in open(f"/proc/{p}/cmdline").read()][0]
    a = snap(pid); t0 = time.time()
    for p in prompts: runner.one(p)
    b = snap(pid); dt = time.time() - t0
    print("wall", round(dt, 2), "threads", len(b))
    rows = sorted(((b[t][1] - a.get(t, (0, 0))[1]), t, b[t][0]) for t in b)
    for d, t, n in rows[::-1][:12]:
        print(t, n, d, "ticks")
    out = subprocess.run([".venv/bin/py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True).stdout
    print([l for l in out.splitlines() if l.startswith("Thread")])
finally:
    app.close()
