#!/usr/bin/env bash
# Issue 7's end-to-end GPU checks in one device call (< 10 min), on two GPUs of one host (or one):
#   GPU 0: the 200-step strict GRPO run (configs/gpu-grpo-200.yaml), stopping after
#          E2E_TRAIN_MINUTES and resumable by running this script again (RESUME=1);
#   GPU 1: SIDE_JOBS=a: doctor, parity on Qwen3-0.6B- and 8B-shaped models, a short native-profile
#          run of the same config (strict/native step time); SIDE_JOBS=b: the rollout benchmark;
#          SIDE_JOBS=c: the CUDA test suite, a smaller rollout benchmark, scripts/gpu_tp.py (2 GPUs).
# Files to $OUT: doctor_cuda.json parity_06b.json parity_8b.json rollout.json
#                gpu200_metrics.jsonl native_metrics.jsonl e2e.log
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/gpu_out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}; RL="$PY -m rlalign.cli.main"
LOG="$OUT/e2e.log"
NGPU=$($PY -c "import torch; print(torch.cuda.device_count())")
SIDE=$(( NGPU > 1 ? 1 : 0 ))
MODEL=runs/m06; RUN=runs/gpu200
{ date -Is; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; git log -1 --format='commit %h %s'
  $PY -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } >> "$LOG" 2>&1

[ -f $MODEL/config.json ] || CUDA_VISIBLE_DEVICES=0 $PY scripts/shaped_model.py qwen3-0.6b $MODEL --tokenizer default >> "$LOG" 2>&1
RESUME_ARG=""; [ -f $RUN/checkpoints/latest.json ] && RESUME_ARG="run.resume=true"
( CUDA_VISIBLE_DEVICES=0 timeout $(( ${E2E_TRAIN_MINUTES:-7} * 60 + 90 )) $RL train configs/gpu-grpo-200.yaml \
    model.path=$MODEL run.dir=$RUN run.progress=false run.max_minutes=${E2E_TRAIN_MINUTES:-7} $RESUME_ARG \
    > "$OUT/train.log" 2>&1; echo "train rc=$?" >> "$OUT/train.log" ) &
TRAIN_PID=$!

side() {  # name, time limit, command...
  local name=$1 limit=$2; shift 2
  echo "== $name (t=$SECONDS s)" >> "$LOG"
  CUDA_VISIBLE_DEVICES=$SIDE timeout "$limit" "$@" >> "$LOG" 2>&1
  echo "== $name rc=$? (t=$SECONDS s)" >> "$LOG"
}
case "${SIDE_JOBS:-a}" in
a)
  side doctor 120 bash -c "$RL doctor --device cuda --json > $OUT/doctor_cuda.json"
  side model_06b 60 $PY scripts/shaped_model.py qwen3-0.6b runs/m06-full
  side parity_06b 120 bash -c "$RL parity --model runs/m06-full --device cuda --prompts 16 --samples 4 --max-new-tokens 64 --json > $OUT/parity_06b.json"
  side model_8b 120 $PY scripts/shaped_model.py qwen3-8b runs/m8b
  side parity_8b 150 bash -c "$RL parity --model runs/m8b --device cuda --prompts 8 --samples 4 --max-new-tokens 32 --json > $OUT/parity_8b.json"
  rm -rf runs/m8b
  side native 100 $RL train configs/gpu-grpo-200.yaml model.path=$MODEL run.dir=runs/native run.steps=12 \
    run.profile=native run.on_mismatch=warn run.progress=false run.eval_every=1000
  cp runs/native/metrics.jsonl "$OUT/native_metrics.jsonl" 2>/dev/null ;;
b)
  side rollout 400 bash -c "$PY bench/rollout.py --device cuda --verify --hf-prompts 64 --json > $OUT/rollout.json" ;;
c)  # the CUDA test suite, a rollout bench of 64 x 8 x 256, then TP=2 vs TP=1 (both GPUs)
  XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n 6 --dist loadfile"
  side cuda_tests 230 bash -c "$PY -m pytest tests -m cuda -q -rfE -p no:cacheprovider $XDIST > $OUT/cuda_tests.log 2>&1"
  tail -n 3 "$OUT/cuda_tests.log" >> "$LOG"
  side rollout 130 bash -c "$PY bench/rollout.py --device cuda --verify --prompts 64 --new-tokens 256 --json > $OUT/rollout.json"
  echo "== gpu_tp (t=$SECONDS s)" >> "$LOG"
  timeout 140 $PY scripts/gpu_tp.py --out "$OUT/tp" >> "$LOG" 2>&1; echo "== gpu_tp rc=$? (t=$SECONDS s)" >> "$LOG" ;;
esac
wait $TRAIN_PID
cat "$OUT/train.log" >> "$LOG"; rm -f "$OUT/train.log"
cp $RUN/metrics.jsonl "$OUT/gpu200_metrics.jsonl" 2>/dev/null
echo "done t=$SECONDS s" >> "$LOG"
tail -n 60 "$LOG"
