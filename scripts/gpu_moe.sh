#!/bin/bash
# MoE on the H200 (issue 18): the CUDA MoE tests, the grouped-GEMM benchmark (Qwen3-30B-A3B shapes) and a
# strict GRPO run on a Qwen3-30B-A3B-shaped model cut to LAYERS layers (configs/moe-h200.yaml).
#   STEPS=60 LAYERS=4 BENCH=1 TESTS=1 bash scripts/gpu_moe.sh          (OUT=dir for the results)
source "$(dirname "$0")/gpu_common.sh" "MoE (issue 18)"
STEPS=${STEPS:-60}; LAYERS=${LAYERS:-4}; BENCH=${BENCH:-1}; TESTS=${TESTS:-1}; NATIVE_STEPS=${NATIVE_STEPS:-0}
mkdir -p /tmp/bin; printf '#!/bin/sh\nexec %s -m rlalign.cli.main "$@"\n' "$PY" > /tmp/bin/rlalign; chmod +x /tmp/bin/rlalign
export PATH=/tmp/bin:$PATH
if [ "$TESTS" = 1 ]; then
  echo "[$(elapsed)s] CUDA MoE tests" | tee -a "$SUMMARY"
  $PY -m pytest -q tests/cuda/test_cuda_moe.py tests/cuda/test_cuda_adversarial.py -k "moe or grouped" 2>&1 | tail -15 | tee -a "$SUMMARY"
fi
if [ "$BENCH" = 1 ]; then
  echo "[$(elapsed)s] grouped GEMM benchmark" | tee -a "$SUMMARY"
  $PY bench/gpu_moe.py --out "$OUT" --tokens "${TOKENS:-4096,8192,16384}" --backward 2>&1 | tail -30 | tee -a "$SUMMARY"
fi
if [ "$STEPS" != 0 ]; then
  echo "[$(elapsed)s] model: qwen3-30b-a3b shape, $LAYERS layers" | tee -a "$SUMMARY"
  [ -d /tmp/moe30b ] || $PY scripts/make_moe_model.py /tmp/moe30b --shape qwen3-30b-a3b --layers "$LAYERS" 2>&1 | tail -2 | tee -a "$SUMMARY"
  echo "[$(elapsed)s] strict GRPO, $STEPS steps" | tee -a "$SUMMARY"
  rm -rf /tmp/moe-h200; mkdir -p "$OUT/moe-h200"
  rlalign train configs/moe-h200.yaml run.dir=/tmp/moe-h200 run.steps="$STEPS" ${TRAIN_ARGS:-} 2>&1 | tail -25 | tee -a "$SUMMARY"
  cp /tmp/moe-h200/*.jsonl /tmp/moe-h200/*.png /tmp/moe-h200/*.yaml "$OUT/moe-h200/" 2>/dev/null
  if [ "$NATIVE_STEPS" != 0 ]; then
    echo "[$(elapsed)s] native GRPO, $NATIVE_STEPS steps" | tee -a "$SUMMARY"
    rm -rf /tmp/moe-h200-native; mkdir -p "$OUT/moe-h200-native"
    rlalign train configs/moe-h200.yaml run.dir=/tmp/moe-h200-native run.steps="$NATIVE_STEPS" run.profile=native \
      run.on_mismatch=warn 2>&1 | tail -12 | tee -a "$SUMMARY"
    cp /tmp/moe-h200-native/*.jsonl /tmp/moe-h200-native/*.png "$OUT/moe-h200-native/" 2>/dev/null
  fi
fi
echo "[$(elapsed)s] done" | tee -a "$SUMMARY"
