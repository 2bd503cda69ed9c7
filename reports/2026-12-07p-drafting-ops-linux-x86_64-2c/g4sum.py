import json, sys, glob
r = json.load(open(glob.glob(sys.argv[1] + "/*.json")[0]))
c = r["configs"]; p = c["plain"]
td = 1000 * p["time_split_s"]["verify"] / p["blocks"]
print("T_decode ms", round(td, 3))
for n, v in c.items():
    if n == "plain": continue
    d = 1000 * v["time_split_s"]["draft"] / v["blocks"]
    print(f"{n:12s} draft ms/block {d:.3f} /T_decode {d/td:.2f} speedup {v['speedup_vs_plain']} tau {v['tau']}")
