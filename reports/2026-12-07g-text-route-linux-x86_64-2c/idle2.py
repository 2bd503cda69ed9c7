import os, sys, time, json
from pathlib import Path
from specula.runtime.bench.served import ServedApp
cfg = json.loads(sys.argv[1]) if len(sys.argv) > 1 else {}
app = ServedApp({"grpc": {"enabled": False}, "drafter": {"gamma": 0}, **cfg}, num_cpus=None, log=Path("/tmp/exp/serve-idle.log"))
def snap():
    out = {}
    for pid in app.processes():
        try:
            cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ")[:90]
            tot = [0, 0]
            for tid in os.listdir(f"/proc/{pid}/task"):
                st = open(f"/proc/{pid}/task/{tid}/stat").read(); f = st[st.rindex(")")+2:].split()
                s = open(f"/proc/{pid}/task/{tid}/status").read()
                tot[0] += int(f[11]) + int(f[12]); tot[1] += int(s.split("voluntary_ctxt_switches:")[1].split()[0])
            out[(pid, cmd)] = tot
        except FileNotFoundError: pass
    return out
try:
    time.sleep(8)
    a = snap(); time.sleep(10); b = snap()
    d = sorted(((b[k][1]-a[k][1], b[k][0]-a[k][0], k) for k in b if k in a), reverse=True)
    print("total wakeups/s", sum(x[0] for x in d) / 10, "cpu %", sum(x[1] for x in d) / 10)
    for x in d: print(x[0] / 10, x[1] / 10, x[2])
finally:
    app.close()
