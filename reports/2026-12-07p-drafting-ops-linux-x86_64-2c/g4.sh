#!/bin/bash
# usage: g4.sh OUT
cd /work/main && .venv/bin/specula bench spec --drafter text_lm --drafter eagle --drafter flash --drafter massv --drafter msd \
  --drafter aasd --drafter ensemble --drafter pooled --drafter caption --suite caption --suite reasoning --suite vqa --n 3 \
  --no-hf --threads 2 --out $1 > $1.log 2>&1
.venv/bin/python /tmp/exp/g4sum.py $1
