import os, time, torch
torch.set_num_threads(2)
from specula.runtime.config import load_config
from specula.runtime.bench.served import _load, world_prompts, in_process_runners
cfg = load_config({})
target, processor = _load(cfg.model.path)
prompts = world_prompts(processor, ["caption"], 6, 0)
r = in_process_runners(target, processor, {"kind": "flash"}, 0, 64)["plain"]
r([prompts[0]])
def snap():
    out = {}
    for tid in os.listdir("/proc/self/task"):
        s = open(f"/proc/self/task/{tid}/status").read()
        st = open(f"/proc/self/task/{tid}/stat").read(); f = st[st.rindex(")")+2:].split()
        out[tid] = (int(f[11]) + int(f[12]), int(s.split("voluntary_ctxt_switches:")[1].split()[0]), int(s.split("nonvoluntary_ctxt_switches:")[1].split()[0]))
    return out
a = snap(); t0 = time.time(); tok = 0
for _ in range(3):
    for p in prompts: tok += r([p])[0]["tokens"]
w = time.time() - t0; b = snap()
print("wall", round(w, 2), "tok/s", round(tok / w, 1))
for k in b:
    if k in a: print(k, [b[k][i] - a[k][i] for i in range(3)])
