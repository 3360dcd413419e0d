#!/bin/bash
# MoE on the H200 (issue 18): the CUDA MoE tests, the grouped-GEMM benchmark (Qwen3-30B-A3B shapes) and strict
# (and native) GRPO runs on a Qwen3-30B-A3B-shaped model cut to LAYERS layers (configs/moe-h200.yaml).
#   STEPS=60 STRICT=1 NATIVE_STEPS=10 LAYERS=4 BENCH=1 TESTS=1 bash scripts/gpu_moe.sh      (OUT=dir for the results)
# Run directories go to /dev/shm when it exists (a checkpoint with fp32 master weights and AdamW state is
# ~40 GB at 4 layers); metrics, config and plots are copied to $OUT.
source "$(dirname "$0")/gpu_common.sh" "MoE (issue 18)"
STEPS=${STEPS:-60}; STRICT=${STRICT:-1}; NATIVE_STEPS=${NATIVE_STEPS:-10}; LAYERS=${LAYERS:-4}; BENCH=${BENCH:-1}; TESTS=${TESTS:-1}
ROOT=/tmp; [ -d /dev/shm ] && ROOT=/dev/shm
mkdir -p /tmp/bin; printf '#!/bin/sh\nexec %s -m rlalign.cli.main "$@"\n' "$PY" > /tmp/bin/rlalign; chmod +x /tmp/bin/rlalign
export PATH=/tmp/bin:$PATH
if [ "$TESTS" = 1 ]; then
  echo "[$(elapsed)s] CUDA MoE tests" | tee -a "$SUMMARY"
  $PY -m pytest -q tests/cuda/test_cuda_moe.py tests/cuda/test_cuda_adversarial.py -k "moe or grouped" 2>&1 | tail -15 | tee -a "$SUMMARY"
fi
if [ "$BENCH" = 1 ]; then
  echo "[$(elapsed)s] grouped GEMM benchmark" | tee -a "$SUMMARY"
  $PY bench/gpu_moe.py --out "$OUT" --tokens "${TOKENS:-4096,8192,16384}" --backward ${BENCH_ARGS:-} 2>&1 | tail -60 | tee -a "$SUMMARY"
fi
train() {   # train NAME STEPS extra-args...
  local name=$1 steps=$2; shift 2
  rm -rf "$ROOT/$name"; mkdir -p "$OUT/$name"
  echo "[$(elapsed)s] GRPO $name, $steps steps $*" | tee -a "$SUMMARY"
  rlalign train configs/moe-h200.yaml run.dir="$ROOT/$name" run.steps="$steps" run.checkpoint_every="$steps" \
    run.keep_checkpoints=1 "$@" 2>&1 | grep -v "^\s*$" | tail -"$((steps + 12))" | tee -a "$SUMMARY"
  cp "$ROOT/$name"/*.jsonl "$ROOT/$name"/*.png "$ROOT/$name"/*.yaml "$ROOT/$name"/*.md "$OUT/$name/" 2>/dev/null
  rm -rf "$ROOT/$name"
}
if [ "$STEPS" != 0 ]; then
  echo "[$(elapsed)s] model: qwen3-30b-a3b shape, $LAYERS layers" | tee -a "$SUMMARY"
  [ -d /tmp/moe30b ] || $PY scripts/make_moe_model.py /tmp/moe30b --shape qwen3-30b-a3b --layers "$LAYERS" 2>&1 | tail -2 | tee -a "$SUMMARY"
  [ "$STRICT" = 1 ] && train moe-h200 "$STEPS" ${TRAIN_ARGS:-}
  [ "$NATIVE_STEPS" != 0 ] && train moe-h200-native "$NATIVE_STEPS" run.profile=native run.on_mismatch=warn ${TRAIN_ARGS:-}
fi
echo "[$(elapsed)s] done" | tee -a "$SUMMARY"
