#!/usr/bin/env bash
# Issues 16/17 on one H200 in one call: the rollout roofline benchmark (strict and native, both with decode
# graphs, and transformers generate; --verify against the trainer) and the training-step benchmark on
# Qwen3-8B shapes (strict, native, stock transformers). Two stages of scripts/gpu_stages.sh, each under its limit.
#   bash scripts/gpu_perf.sh              WORKLOAD=0.6b-ctx512 TRAIN_LAYERS=6 ROLL_SECONDS=300 TRAIN_SECONDS=200
stages=roll
[ "${TRAIN_LAYERS:-6}" != 0 ] && stages="roll train"
STAGES=$stages ROLL="${WORKLOAD:-0.6b-ctx512}" ROLL_ENGINES=strict,native,transformers ROLL_S="${ROLL_SECONDS:-300}" \
  TR_LAYERS="${TRAIN_LAYERS:-6}" TR_S="${TRAIN_SECONDS:-200}" exec bash "$(dirname "$0")/gpu_stages.sh"
