import json, os, sys, time
from pathlib import Path
from specula.runtime.bench.served import ServedApp, ServedRunner, world_prompts, _load, configs
import torch
torch.set_num_threads(2)
gamma = int(sys.argv[1])
target, processor = _load(__import__("specula.runtime.config", fromlist=["x"]).load_config({}).model.path)
prompts = world_prompts(processor, ["caption"], 6, 0)
cfg = {"grpc": {"enabled": False}, "drafter": {"gamma": gamma}} if gamma == 0 else {"grpc": {"enabled": False}}
app = ServedApp(cfg, num_cpus=None, log=Path("/tmp/exp/serve-threads.log"))
try:
    r = ServedRunner(app.url, 64, 1)
    r([prompts[0]])
    def snap():
        out = {}
        for pid in app.processes():
            try:
                comm = open(f"/proc/{pid}/comm").read().strip()
                for tid in os.listdir(f"/proc/{pid}/task"):
                    st = open(f"/proc/{pid}/task/{tid}/stat").read()
                    name = st[st.index("(")+1:st.rindex(")")]
                    f = st[st.rindex(")")+2:].split()
                    out[(pid, comm, int(tid), name)] = (int(f[11]) + int(f[12]), int(f[7]) if False else 0)
                    # voluntary/involuntary ctx switches from status
                    s = open(f"/proc/{pid}/task/{tid}/status").read()
                    v = int(s.split("voluntary_ctxt_switches:")[1].split()[0]); nv = int(s.split("nonvoluntary_ctxt_switches:")[1].split()[0])
                    out[(pid, comm, int(tid), name)] = (int(f[11]) + int(f[12]), v, nv)
            except FileNotFoundError:
                pass
        return out
    a = snap(); t0 = time.time()
    rows = r(prompts * 3)
    w = time.time() - t0; b = snap()
    tok = sum(x["tokens"] for x in rows)
    print("wall", round(w, 2), "tok/s", round(tok / w, 1))
    d = []
    for k in b:
        if k in a:
            d.append((b[k][0]-a[k][0], b[k][1]-a[k][1], b[k][2]-a[k][2], k))
    d.sort(reverse=True)
    for x in d[:25]:
        if x[0] or x[1] > 10: print(x)
finally:
    app.close()
