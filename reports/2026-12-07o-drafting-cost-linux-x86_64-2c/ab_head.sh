#!/bin/bash
cd /work/main
D="--drafter eagle --drafter msd --drafter aasd --drafter flash"
for i in 1 2; do
 for v in off on; do
  if [ $v = off ]; then export NO_INT8_HEAD=1; else unset NO_INT8_HEAD; fi
  .venv/bin/python /tmp/exp/run_bench.py bench spec $D --suite caption --suite reasoning --suite vqa --n 3 --no-hf --threads 2 --out /tmp/exp/ab_$v$i > /tmp/exp/ab_$v$i.log 2>&1
  echo "== $v $i"; .venv/bin/python /tmp/exp/g4sum.py /tmp/exp/ab_$v$i
 done
done
