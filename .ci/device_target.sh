#!/bin/bash
# A target cycle on a CUDA machine (CI has none and does not run this): the joint stage of the recipe's
# frozen-vision flags on the scan_placed mix (zoo/TRAINING.md, "Prompts that do not open with their image: the placed
# mix"), on the GPU for MINUTES, then the export, fp16, in parts small enough for a lease's file limits (16 MiB each).
#   bash .ci/device_target.sh OUT_DIR [MINUTES] [INIT] [SAMPLES]     (DEVICE=cpu THREADS=1 to try it here)
# INIT: exported weights or a run's ckpt to start from (default: zoo/candidates/target when there is one, else the
# shipped target); SAMPLES: the schedule's length (default 80000, the placed mix's CPU run's). Back here:
#   tar -C zoo/candidates/target -xf OUT_DIR/export-files.tar
#   cat OUT_DIR/model.safetensors.part-* > zoo/candidates/target/model.safetensors
# then `specula zoo eval --model zoo/candidates/target` and `zoo manifest` as for any candidate.
# The tree that travels must stay under 64 MiB: move zoo/weights/* other than target and tokenizer out first, and put
# a transformers wheel of the pinned range into gpu/ for SPECULA_LAYOUT=1 (the machine has no registry).
set -eu
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:?OUT_DIR}; MINUTES=${2:-8}; SAMPLES=${4:-80000}
Z=zoo/candidates; [ -f "$R/$Z/target/config.json" ] || Z=zoo/weights
INIT=${3:-$Z/target}
mkdir -p "$OUT"
. "$R/.ci/specula_cmd.sh"
cd "$R"
RUN=/tmp/specula-target-run
"${SPECULA[@]}" train target --run-dir $RUN --device "${DEVICE:-cuda}" --max-minutes "$MINUTES" --threads "${THREADS:-8}" --init-from "$INIT" \
  --freeze-vision --tower-lr-mult 0.02 --aux-out 0 --code-lm-samples 40000 --code-lm-layers 4 \
  --code-lm-mix confusable --referent-attention 0 --vision-images 180000 --vision-place-weight 1 \
  --projector-fit-images 960 --projector-fit-gate --vis-weight 0 --object-cell-weight 3 --samples "$SAMPLES" \
  --lr 6e-4 --mix scan_placed 2>&1 | tr '\r' '\n' | grep -v "it/s\]$" | tail -40 > "$OUT/train.log"
"${SPECULA[@]}" zoo export --ckpt $RUN/ckpt --out /tmp/specula-target-export
cp $RUN/ckpt/state.json "$OUT/"
# at most 8 files come back: the weights in 15 MB parts, the export's other files in one tar
split -b 15m -d /tmp/specula-target-export/model.safetensors "$OUT/model.safetensors.part-"
tar -C /tmp/specula-target-export -cf "$OUT/export-files.tar" --exclude model.safetensors .
ls -la "$OUT"
