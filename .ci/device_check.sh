#!/bin/bash
# The CUDA checks, for a machine with an NVIDIA GPU (CI has none and does not run this).
#   bash .ci/device_check.sh [OUT_DIR]
# 1. tests/runtime/test_cuda.py: greedy speculative decoding on the GPU equals plain decoding (ngram, random chain
#    and tree drafters, drafts made on the CPU), sampled output reproducible per seed, verification of drafts from
#    another device; and the target trainer's joint stage on CUDA (tests/training/test_train_target.py), its checkpoint
#    resumed on the CPU; an eagle head trained on the GPU for tiny LLaVA-1.5 and Qwen2.5-VL checkpoints in the stock
#    layouts from a conversation file, then served in-process on the GPU, greedy answers equal to plain decoding
#    (tests/training/test_your_model_cuda.py);
# 2. bench spec on cuda with the candidate zoo (zoo/candidates, when there is one) or else the shipped one: its
#    target with ngram, eagle, flash and msd (tau, speedup vs plain, exactness), JSON +
#    markdown into OUT_DIR (default reports/cuda);
# 3. bench served on cuda: `specula serve` with the verifier, the vision encoder and a separate drafter (flash) on the
#    GPU, and its gamma-0 twin, over HTTP at 1 and 8 streams (caption, vqa, text), against in-process decoding on the
#    GPU (OUT_DIR/served).
# Works with `pip install -e .` or, on a machine that cannot install (no registry), from a package layout of the
# checkout built here (SPECULA_LAYOUT=1): a transformers wheel of the pinned range may be put in gpu/.
set -eu
R=$(cd "$(dirname "$0")/.." && pwd)
OUT=${1:-$R/reports/cuda}
mkdir -p "$OUT"
. "$R/.ci/specula_cmd.sh"
(cd /tmp && python3 -m pytest -q -p no:cacheprovider -o addopts="" "$R/tests/runtime/test_cuda.py" \
  "$R/tests/training/test_train_target.py::test_joint_stage_trains_on_cuda_and_checkpoints_on_the_cpu" \
  "$R/tests/training/test_your_model_cuda.py")
cd "$R"
Z=zoo/candidates; [ -d $Z/target ] || Z=zoo/weights
DR=()
for d in eagle flash msd; do
  if [ -f $Z/$d/specula.json ]; then DR+=(--drafter "{\"kind\": \"$d\", \"path\": \"$Z/$d\"}"); fi
done
"${SPECULA[@]}" bench spec --device cuda --model $Z/target --drafter ngram "${DR[@]}" --gamma 5 --n 2 --max-tokens 64 \
  --out "$OUT"
cat > "$OUT/served-cuda.yaml" <<EOF
model: {path: $Z/target}
drafter: {kind: flash, options: {path: $Z/flash}}
deployments:
  vision_encoder: {device: cuda, ray_actor_options: {num_cpus: 1, num_gpus: 0.2}}
  drafter_ensemble: {device: cuda, ray_actor_options: {num_cpus: 1, num_gpus: 0.2}}
  target_verifier: {device: cuda, ray_actor_options: {num_cpus: 2, num_gpus: 0.6}}
EOF
"${SPECULA[@]}" bench served --config "$OUT/served-cuda.yaml" --device cuda --suite caption --suite vqa --suite text \
  --n 4 --out "$OUT/served"
