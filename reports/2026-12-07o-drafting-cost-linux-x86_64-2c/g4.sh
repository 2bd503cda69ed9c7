#!/bin/bash
# usage: g4.sh OUT
cd /work/main && .venv/bin/specula bench spec --drafter text_lm --drafter eagle --drafter flash --drafter massv --drafter msd \
  --drafter aasd --drafter ensemble --drafter pooled --drafter caption --suite caption --suite reasoning --suite vqa --n 3 \
  --no-hf --threads 2 --out $1 > $1.log 2>&1
.venv/bin/python /tmp/exp/g4sum.py $1; exit
import json, sys, glob
r = json.load(open(glob.glob(sys.argv[1] + "/*.json")[0]))
cfgs = r.get("configs") or r
plain = cfgs["plain"]["all"]
td = 1000 * plain["time_split_s"]["verify"] / plain["blocks"]
print("T_decode ms", round(td, 3))
for n, c in cfgs.items():
    a = c["all"]
    if n != "plain":
        print(f"{n:10s} draft ms/block {a['draft_ms_per_block']:.3f}  /T_decode {a['draft_ms_per_block']/td:.2f}  speedup {a.get('speedup_vs_plain')}  tau {a.get('tau')}")
PY
