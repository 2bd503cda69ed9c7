#!/bin/bash
# The ensemble's members joining on demand vs massv (its best member alone) vs IbED's at-once ensemble.
# Usage: bash run.sh OUT_DIR (from any folder; a quiet machine).
set -e
OUT=$(realpath -m "$1")
cd "$(dirname "$0")/../.."
S=.venv/bin/specula
AT_ONCE='{"kind":"ensemble","join":"at_once","label":"ensemble_at_once"}'
$S bench spec --drafter massv --drafter ensemble --drafter "$AT_ONCE" \
  --gamma 5 --n 6 --threads 2 --no-hf --temperature 0 --out "$OUT/greedy_all_suites"
$S bench spec --drafter massv --drafter ensemble --drafter "$AT_ONCE" \
  --gamma 5 --suite caption --suite reasoning --suite chart --suite text --n 6 --threads 2 --no-hf --temperature 1.0 \
  --out "$OUT/sampled_t1"
for T in 1.0 0.7; do  # where the members join: reasoning; the threshold (join_below) 0.6 / 0.7 (default) / 0.8
  $S bench spec --drafter massv --drafter '{"kind":"ensemble","join_below":0.6,"label":"j06"}' \
    --drafter '{"kind":"ensemble","join_below":0.7,"label":"j07"}' \
    --drafter '{"kind":"ensemble","join_below":0.8,"label":"j08"}' --drafter "$AT_ONCE" \
    --gamma 5 --suite reasoning --suite caption --n 10 --threads 2 --no-hf --temperature $T --out "$OUT/thresholds_t$T"
done
