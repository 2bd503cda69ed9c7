#!/bin/bash
# The ensemble's members joining on demand vs massv (its best member alone) vs IbED's at-once ensemble.
set -e
cd "$(dirname "$0")/../.."
S=.venv/bin/specula
$S bench spec --drafter massv --drafter ensemble --drafter '{"kind":"ensemble","join":"at_once","label":"ensemble_at_once"}' \
  --gamma 5 --n 6 --threads 2 --no-hf --temperature 0 --out "$1/greedy_all_suites"
$S bench spec --drafter massv --drafter ensemble --drafter '{"kind":"ensemble","join":"at_once","label":"ensemble_at_once"}' \
  --gamma 5 --suite caption --suite reasoning --suite chart --suite text --n 6 --threads 2 --no-hf --temperature 1.0 \
  --out "$1/sampled_t1"
