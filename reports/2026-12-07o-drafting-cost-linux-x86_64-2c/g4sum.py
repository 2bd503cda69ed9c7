import json, sys, glob
r = json.load(open(glob.glob(sys.argv[1] + "/*.json")[0]))
cfgs = r["configs"]
plain = cfgs["plain"]
td = 1000 * plain["time_split_s"]["verify"] / plain["blocks"]
print("T_decode ms", round(td, 3))
for n, c in cfgs.items():
    if n != "plain":
        dm = 1000 * c["time_split_s"]["draft"] / c["blocks"]
        print(f"{n:12s} draft ms/block {dm:.3f}  /T_decode {dm/td:.2f}  speedup {c['speedup_vs_plain']}  tau {c['tau']}")
