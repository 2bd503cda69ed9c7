#!/bin/bash
cd /work/main
for i in 1 2; do
 for v in fp32 int8 bf16; do
  if [ $v = fp32 ]; then unset HEAD; else export HEAD=$v; fi
  .venv/bin/python /tmp/exp/run_bench.py bench spec --drafter text_lm --drafter massv --suite caption --suite reasoning --suite vqa --n 3 --no-hf --threads 2 --out /tmp/exp/tlh_$v$i > /tmp/exp/tlh_$v$i.log 2>&1
  echo "== $v $i"; .venv/bin/python /tmp/exp/g4sum.py /tmp/exp/tlh_$v$i
 done
done
