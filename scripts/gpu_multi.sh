#!/bin/bash
# Issue 21's multi-GPU runs in one device job on 2, 4 or 8 GPUs of one host (NCCL, NVLink multicast off).
# G = the GPUs torch sees (GPUS=n overrides); the TP degrees are those of 1, 2, 4, 8 that divide G. Stages run in
# this order, each under its own limit in seconds (0 skips it) and never past DEADLINE (default 570 s):
#   TP_S      item 1: scripts/gpu_tp.py --tp <degrees> --layers $LAYERS (default 36: the full Qwen3-8B shape,
#             151,936-token vocabulary, bf16): log-probs, entropy, loss and every gradient of TP=t vs TP=1 in
#             raw bits, strict and native step time per degree                               -> gpu_tp.json
#   COLL_S    item 3: benchmarks/collectives.py (the fixed all-gather + tree merge vs NCCL's all-reduce and
#             reduce-scatter at a step's sizes, groups of 2, 4, 8)                             -> collectives.json
#   TRAIN_S   item 2: strict GRPO (configs/gpu-grpo-200.yaml: the Qwen3-0.6B body, default vocabulary) for
#             TRAIN_STEPS (20) steps at parallel.tp=1 on one GPU and parallel.tp=2; with G >= 4 also
#             parallel.dp=2 x tp=2 and dp=2 x tp=1; runs side by side where GPUs allow. Verdicts: mismatch/count
#             at every step, and `python -m rlalign.integrations.ray.compare` (metrics + exported weights, bits):
#             tp=2 vs the one-GPU tp=1 run, dp2 x tp2 vs dp2 x tp1     -> metrics_tp2.jsonl, metrics_dp2tp2.jsonl
#   PARITY_S  item 1: `rlalign parity --tp <degrees> --device cuda` on a PARITY_LAYERS-layer (default $LAYERS)
#             Qwen3-8B-shaped checkpoint made here                                             -> parity_tp.json
#   TRAIN8B_S item 2 on the 8B shape: configs/qwen3-8b-h200-device.yaml with parallel.tp=$TP8B (default G)
#             and parallel.dp=$DP8B (default 1; TP8B x DP8B GPUs: TP8B=2 DP8B=2 is the issue's layout), TRAIN_STEPS
#             steps, LAYERS8B layers (default $LAYERS); run.max_minutes from the time left
#                                                                                           -> metrics_8b_tp.jsonl
# PART picks the default limits: PART=1 (default) TP_S=200 COLL_S=80 TRAIN_S=260 (PARITY_S, TRAIN8B_S 0);
# PART=2 PARITY_S=240 TRAIN8B_S=300 (the others 0); PART=all every stage (needs more than one 10-minute job).
# A *_S variable set in the environment wins over PART's. Results, flat under $OUT (at most 8 files):
# summary.txt (versions, each stage's verdict), log.txt (every stage's output), and the files named above.
#   bash scripts/gpu_multi.sh                       # part 1: TP degrees, collectives, the 0.6B runs
#   PART=2 bash scripts/gpu_multi.sh                # part 2: parity --tp on CUDA, the 8B run under TP
#   TP_S=0 COLL_S=0 TRAIN_S=500 bash scripts/gpu_multi.sh
#   LAYERS=8 TRAIN_STEPS=20 bash scripts/gpu_multi.sh
# The CPU rehearsal (tests/distributed/test_gpu_multi_script.py) runs it with GPUS=n SMOKE=1: gloo processes,
# tiny shapes, model.device=cpu.
source "$(dirname "$0")/gpu_common.sh" "multi-GPU kit (issue 21)"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1   # the hosts require it
DEADLINE=${DEADLINE:-570}; LAYERS=${LAYERS:-36}; TRAIN_STEPS=${TRAIN_STEPS:-20}; SMOKE=${SMOKE:-0}
case "${PART:-1}" in
  1)   D_TP=200; D_COLL=80;  D_TRAIN=260; D_PARITY=0;   D_8B=0 ;;
  2)   D_TP=0;   D_COLL=0;   D_TRAIN=0;   D_PARITY=240; D_8B=300 ;;
  all) D_TP=200; D_COLL=80;  D_TRAIN=260; D_PARITY=240; D_8B=300 ;;
  *)   echo "PART=${PART} is not 1, 2 or all" | tee -a "$SUMMARY"; exit 2 ;;
esac
TP_S=${TP_S:-$D_TP}; COLL_S=${COLL_S:-$D_COLL}; TRAIN_S=${TRAIN_S:-$D_TRAIN}
PARITY_S=${PARITY_S:-$D_PARITY}; TRAIN8B_S=${TRAIN8B_S:-$D_8B}
LOG="$OUT/log.txt"; : > "$LOG"
RL="$PY -m rlalign.cli.main"
# models and run directories: in memory where there is /dev/shm; a folder of its own, removed at the end
[ -n "${ROOT:-}" ] || { ROOT=/tmp; [ -d /dev/shm ] && ROOT=/dev/shm; }
ROOT=$ROOT/rlalign-multi-$$
mkdir -p "$ROOT"
left() { echo $(( DEADLINE - $(elapsed) )); }
say() { echo "[$(elapsed)s] $*" | tee -a "$SUMMARY" >> "$LOG"; }
FAILURES=0
fail() { FAILURES=$(( FAILURES + 1 )); say "FAILED: $*"; }

# ---- the GPUs: G, their ids (CUDA_VISIBLE_DEVICES may already pick some), the degrees ----------------------
if [ -z "${GPUS:-}" ]; then
  GPUS=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
fi
G=$GPUS
if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then IFS=, read -r -a IDS <<< "$CUDA_VISIBLE_DEVICES"; else IDS=($(seq 0 $(( G - 1 )))); fi
DEGREES=""; for t in 1 2 4 8; do [ "$t" -le "$G" ] && [ $(( G % t )) = 0 ] && DEGREES="${DEGREES:+$DEGREES,}$t"; done
say "GPUs: $G (ids ${IDS[*]:-none}); TP degrees $DEGREES; stages (s): tp $TP_S, collectives $COLL_S, train $TRAIN_S," \
    "parity $PARITY_S, train 8B $TRAIN8B_S; deadline $DEADLINE s; NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE"
if [ "$G" -lt 2 ]; then say "FAILED: needs at least 2 GPUs (found $G)"; exit 1; fi
if [ "$SMOKE" = 1 ]; then   # the CPU rehearsal: gloo, tiny shapes
  TP_ARGS=(--smoke); COLL_ARGS=(--smoke --ranks "$(echo "$DEGREES" | sed 's/^1,//')")
else
  TP_ARGS=(--layers "$LAYERS"); COLL_ARGS=(--ranks "$(echo "$DEGREES" | sed 's/^1,//')")
fi

# limit LIMIT_S: the stage's limit, cut to the time left before the deadline (>= 0)
limit() { local l; l=$(left); [ "$1" -lt "$l" ] && l=$1; echo $(( l > 0 ? l : 0 )); }
exit_status() { echo "exit status $1$( { [ "$1" = 124 ] || [ "$1" = 137 ]; } && echo ' (cut by the time limit)')"; }
# in_stage LIMIT NAME CMD...: run CMD under the limit (its process group killed at the end), output to log.txt
in_stage() {
  local lim=$1 name=$2; shift 2
  if [ "$lim" -le 0 ]; then say "$name: skipped (no time left)"; return 124; fi
  echo "== $name (limit $lim s): $*" >> "$LOG"
  timeout --kill-after=15 "$lim" "$@" >> "$LOG" 2>&1
  local rc=$?
  [ "$rc" = 124 ] || [ "$rc" = 137 ] && say "$name: cut by its time limit ($lim s)"
  return $rc
}

# ---- item 1: TP degrees on the full shape ------------------------------------------------------------------
if [ "$TP_S" -gt 0 ]; then
  say "tp: scripts/gpu_tp.py --tp $DEGREES ${TP_ARGS[*]}"
  in_stage "$(limit "$TP_S")" tp $PY scripts/gpu_tp.py --out "$ROOT/tp" --tp "$DEGREES" "${TP_ARGS[@]}"
  rc=$?; say "tp: exit $rc (0: every degree bitwise equal to TP=1; 1: a difference; 2: refused)"
  [ "$rc" = 0 ] || fail "tp: exit $rc"
  if [ -f "$ROOT/tp/gpu_tp.json" ]; then
    cp "$ROOT/tp/gpu_tp.json" "$OUT/gpu_tp.json"
    $PY - "$OUT/gpu_tp.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
d = json.load(open(sys.argv[1]))
print(f"  {d['model']['layers']} layers, {d['batch']['tokens']} tokens, complete={d['complete']}")
for t in d["degrees"]:
    m = d.get(f"tp{t}_vs_tp1") or {}
    times = {p: (d.get(f"time_tp{t}_{p}") or {}).get("median_s") for p in ("strict", "native")}
    bits = "reference" if t == 1 else (f"lp {m['lp']['differ']} ent {m['ent']['differ']} loss {m['loss']['differ']} "
                                       f"differing grad elements {m.get('grads_differ_total')} of "
                                       f"{m.get('grads_compared')} tensors" if m else "not compared")
    print(f"  TP={t}: {bits}; step strict {times['strict']} s native {times['native']} s")
errors = [f"{k}: {v['error']}" for k, v in d.items() if isinstance(v, dict) and "error" in v]
print("  errors: " + ("; ".join(errors) or "none"))
EOF
  fi
fi

# ---- item 3: collectives -----------------------------------------------------------------------------------
if [ "$COLL_S" -gt 0 ]; then
  say "collectives: benchmarks/collectives.py ${COLL_ARGS[*]}"
  in_stage "$(limit "$COLL_S")" collectives $PY benchmarks/collectives.py --out "$ROOT/coll" "${COLL_ARGS[@]}"
  rc=$?; say "collectives: exit $rc (0: every fixed result checked equal to the local tree merge)"
  [ "$rc" = 0 ] || fail "collectives: exit $rc"
  [ -f "$ROOT/coll/collectives.json" ] && cp "$ROOT/coll/collectives.json" "$OUT/collectives.json"
  grep -E "^ranks .* tokens (1|4096|8192) |^ranks .* (1048576|268435456) " "$LOG" | tail -n 24 | sed 's/^/  /' | tee -a "$SUMMARY"
fi

# ---- item 2: training runs ---------------------------------------------------------------------------------
# train_job NAME FIRST N STOP_BY ARGS...: `rlalign train` on GPUs IDS[FIRST..FIRST+N-1], in the background
train_job() {
  local name=$1 first=$2 n=$3 stop_by=$4; shift 4
  local devs; devs=$(IFS=,; echo "${IDS[*]:$first:$n}")
  rm -rf "$ROOT/run_$name"
  echo "== train $name on GPUs $devs: $*" >> "$LOG"
  local lim=$(( stop_by - $(elapsed) ))   # timeout 0 would mean no limit
  ( CUDA_VISIBLE_DEVICES=$devs timeout --kill-after=15 "$(( lim > 1 ? lim : 1 ))" \
      $RL train "$@" run.dir="$ROOT/run_$name" > "$ROOT/run_$name.log" 2>&1
    exit_status $? >> "$ROOT/run_$name.log" ) &
}
# run_waves STOP_BY "NAME:GPUS:ARGS" ...: as many jobs side by side as the GPUs hold, wave after wave
run_waves() {
  local stop_by=$1; shift
  local pending=("$@")
  while [ ${#pending[@]} -gt 0 ] && [ "$(elapsed)" -lt "$stop_by" ]; do
    local next=0 deferred=() job
    for job in "${pending[@]}"; do
      IFS=: read -r name n args <<< "$job"
      if [ $(( next + n )) -le "$G" ]; then
        # shellcheck disable=SC2086  # ARGS are word-split on purpose
        train_job "$name" "$next" "$n" "$stop_by" "${TRAIN_CFG[@]}" $args
        next=$(( next + n ))
      else
        deferred+=("$job")
      fi
    done
    wait
    pending=("${deferred[@]}")
  done
}
# verdict NAME [LOG]: exit status (and the log's last lines when it is not 0), steps, mismatches (all must be 0),
# median step time
verdict() {
  local log=${2:-$ROOT/run_$1.log} status
  status=$(grep "^exit status" "$log" 2>/dev/null | tail -n 1)
  say "run $1: ${status:-no exit status}"
  [ "$status" != "exit status 0" ] && grep -v "^\s*$" "$log" 2>/dev/null | tail -n 4 | sed 's/^/  | /' | tee -a "$SUMMARY"
  $PY - "$ROOT/run_$1" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, statistics, sys
from pathlib import Path
path = Path(sys.argv[1]) / "metrics.jsonl"
rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
steps = [r for r in rows if "mismatch/tokens" in r]
if not steps:
    print(f"  {path.parent.name}: no training step recorded"); sys.exit(1)
bad = [r["step"] for r in steps if r["mismatch/count"] != 0]
print(f"  {path.parent.name}: {len(steps)} steps, {sum(r['mismatch/tokens'] for r in steps):,} log-probs compared, "
      f"mismatches {sum(r['mismatch/count'] for r in steps)} (steps with any: {bad or 'none'}); median step "
      f"{statistics.median(r['time/rollout_s'] + r['time/train_s'] for r in steps):.2f} s; reward "
      f"{steps[0].get('reward/mean', float('nan')):.3f} -> {steps[-1].get('reward/mean', float('nan')):.3f}")
sys.exit(1 if bad else 0)
EOF
  [ "${PIPESTATUS[0]}" = 0 ] || fail "run $1: no step recorded, or log-prob mismatches"
  [ "$status" = "exit status 0" ] || fail "run $1: ${status:-no exit status}"
}
compare() {   # compare A B [info]: the metrics and exported weights, bitwise (info: a difference is no failure)
  say "compare $1 vs $2 (metrics + exported weights)${3:+, for information}:"
  $PY -m rlalign.integrations.ray.compare "$ROOT/run_$1" "$ROOT/run_$2" 2>&1 | tail -n 6 | sed 's/^/  /' | tee -a "$SUMMARY"
  [ "${PIPESTATUS[0]}" = 0 ] || [ -n "${3:-}" ] || fail "compare $1 vs $2: not identical (or a run is missing)"
}

if [ "$TRAIN_S" -gt 0 ] && [ "$(limit "$TRAIN_S")" -gt 30 ]; then
  STOP_BY=$(( $(elapsed) + $(limit "$TRAIN_S") ))
  M06=$ROOT/m06
  if [ "$SMOKE" = 1 ]; then
    # the 8B config's training features on the embedded default model: bf16 with fp32 masters, the optimizer
    # step in chunks, activation checkpointing
    TRAIN_CFG=(rollout.prompts_per_step=4 rollout.samples_per_prompt=4 run.eval_every=2 task.eval_size=2
               run.eval_samples=1 optim.micro_batch_tokens=64 run.progress=false run.save_checkpoints=false
               run.steps="$TRAIN_STEPS" model.device=cpu model.dtype=bfloat16 optim.master_weights=true
               optim.step_chunk_elements=10000 optim.activation_checkpointing=true)
  else
    say "train: model qwen3-0.6b body (default vocabulary) -> $M06"
    in_stage "$(limit 120)" make_m06 $PY scripts/shaped_model.py qwen3-0.6b "$M06" --tokenizer default
    # micro-batches of 2,048 tokens: a step's ~6k tokens in several, so each DP rank back-propagates its own
    TRAIN_CFG=(configs/gpu-grpo-200.yaml model.path="$M06" run.steps="$TRAIN_STEPS" run.eval_every=10
               run.save_checkpoints=false run.progress=false optim.micro_batch_tokens=2048)
  fi
  JOBS=("tp2:2:parallel.tp=2" "tp1:1:parallel.tp=1")
  [ "$G" -ge 4 ] && JOBS=("dp2tp2:4:parallel.dp=2 parallel.tp=2" "${JOBS[@]}" "dp2tp1:2:parallel.dp=2 parallel.tp=1")
  say "train: ${#JOBS[@]} runs of $TRAIN_STEPS steps (${JOBS[*]}), until t=${STOP_BY}s"
  run_waves "$STOP_BY" "${JOBS[@]}"
  for job in "${JOBS[@]}"; do verdict "${job%%:*}"; done
  compare tp1 tp2
  if [ "$G" -ge 4 ]; then
    compare dp2tp1 dp2tp2
    # DP sums each rank's accumulated gradients by the tree: bitwise across TP at a fixed DP degree, not
    # promised against one process accumulating every micro-batch (docs/distributed.md)
    compare tp1 dp2tp2 info
  fi
  cp "$ROOT/run_tp2/metrics.jsonl" "$OUT/metrics_tp2.jsonl" 2>/dev/null
  [ "$G" -ge 4 ] && cp "$ROOT/run_dp2tp2/metrics.jsonl" "$OUT/metrics_dp2tp2.jsonl" 2>/dev/null
  for job in "${JOBS[@]}"; do cat "$ROOT/run_${job%%:*}.log" >> "$LOG" 2>/dev/null; done
  rm -rf "$ROOT"/run_*
fi

# ---- item 1 through the CLI: parity --tp on CUDA -----------------------------------------------------------
Q8B=$ROOT/q8b
make_8b() {   # make_8b LAYERS: a random-init Qwen3-8B-shaped checkpoint (full vocabulary) in $Q8B
  if [ "$(cat "$Q8B/.layers" 2>/dev/null)" != "$1" ]; then
    rm -rf "$Q8B"
    if [ "$SMOKE" = 1 ]; then
      in_stage "$(limit 120)" make_8b $PY scripts/make_qwen3_8b.py "$Q8B" --layers "$1" --test-body --vocab 3000 \
        --device cpu
    else
      in_stage "$(limit 180)" make_8b $PY scripts/make_qwen3_8b.py "$Q8B" --layers "$1"
    fi
    [ -f "$Q8B/config.json" ] && echo "$1" > "$Q8B/.layers"
  fi
  [ -f "$Q8B/config.json" ]
}
if [ "$PARITY_S" -gt 0 ]; then
  STOP_BY=$(( $(elapsed) + $(limit "$PARITY_S") ))
  say "parity: Qwen3-8B shape, ${PARITY_LAYERS:-$LAYERS} layers -> $Q8B"
  if make_8b "${PARITY_LAYERS:-$LAYERS}"; then
    PDEV=cuda; [ "$SMOKE" = 1 ] && PDEV=cpu
    in_stage "$(( STOP_BY - $(elapsed) ))" parity bash -c "$RL parity --model $Q8B --device $PDEV --tp $DEGREES \
      --prompts 4 --samples 2 --max-new-tokens 16 --json > $OUT/parity_tp.json"
    rc=$?; say "parity: exit $rc (0: every degree's log-probs equal TP=1's and the rollout's)"
    [ "$rc" = 0 ] || fail "parity: exit $rc"
    $PY - "$OUT/parity_tp.json" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
lines = [l for l in open(sys.argv[1]).read().splitlines() if l.startswith("{")]   # the --json object's line
d = json.loads(lines[-1]) if lines else {}
if not d:
    sys.exit("  no JSON from rlalign parity (its output is in log.txt)")
print(f"  ok={d['ok']}: rollout vs train {d['mismatches']} of {d['tokens_compared']} differ")
for t, r in sorted(d.get("tp", {}).items(), key=lambda kv: int(kv[0])):
    print(f"  TP={t}: {r['mismatches']} of {r['tokens_compared']} differ from TP=1, {r['rollout_mismatches']} from the rollout")
EOF
  else
    fail "parity: no checkpoint"
  fi
fi

# ---- item 2 on the 8B shape: parallel.tp=G ----------------------------------------------------------------
if [ "$TRAIN8B_S" -gt 0 ]; then
  STOP_BY=$(( $(elapsed) + $(limit "$TRAIN8B_S") ))
  TP8B=${TP8B:-$G}; [ "$TP8B" -gt 8 ] && TP8B=8
  DP8B=${DP8B:-1}; WORLD8B=$(( TP8B * DP8B ))
  say "train 8B: parallel.tp=$TP8B parallel.dp=$DP8B, ${LAYERS8B:-$LAYERS} layers, $TRAIN_STEPS steps"
  if [ "$WORLD8B" -gt "$G" ]; then
    fail "train 8B: TP8B x DP8B = $WORLD8B GPUs, $G here"
  elif make_8b "${LAYERS8B:-$LAYERS}"; then
    # the loop stops cleanly (metrics, exported policy) ~60 s before the stage's end: start-up ~60 s, the end ~60 s
    MAX_MIN=$($PY -c "print(round(max(($STOP_BY - $(elapsed) - 120) / 60, 0.5), 2))")
    if [ "$SMOKE" = 1 ]; then
      ARGS8B=(rollout.prompts_per_step=2 rollout.samples_per_prompt=2 rollout.max_new_tokens=8 task.eval_size=2
              run.eval_samples=1 optim.micro_batch_tokens=64 model.device=cpu)
    else
      ARGS8B=(configs/qwen3-8b-h200-device.yaml)
    fi
    GPUS_8B=$(IFS=,; echo "${IDS[*]:0:$WORLD8B}")
    rm -rf "$ROOT/run_8b"
    in_stage "$(( STOP_BY - $(elapsed) ))" train_8b env CUDA_VISIBLE_DEVICES="$GPUS_8B" $RL train "${ARGS8B[@]}" \
      model.path="$Q8B" parallel.tp="$TP8B" parallel.dp="$DP8B" run.steps="$TRAIN_STEPS" run.max_minutes="$MAX_MIN" run.progress=false \
      run.eval_every=10 run.save_checkpoints=false run.dir="$ROOT/run_8b"
    exit_status $? >> "$LOG"
    verdict 8b "$LOG"
    cp "$ROOT/run_8b/metrics.jsonl" "$OUT/metrics_8b_tp.jsonl" 2>/dev/null
    rm -rf "$ROOT/run_8b"
  else
    fail "train 8B: no checkpoint"
  fi
fi
rm -rf "$ROOT"
say "done, $FAILURES failed checks; files: $(cd "$OUT" && ls | tr '\n' ' ')"
[ "$FAILURES" = 0 ]
