#!/bin/bash
# Issue 17's headline run in ONE GPU job (<= DEADLINE seconds, default 570): the full Qwen3-8B shape (36 layers,
# 151,936-token vocabulary, bf16 weights, fp32 masters and AdamW state all on the H200), strict GRPO with
# configs/qwen3-8b-h200-device.yaml (10 x 8 samples of 64 tokens at top-p 0.95, the engine sharing the policy's
# weights, the optimizer step in chunks), for up to STEPS steps; run.max_minutes is set from the time left so
# the run ends cleanly (metrics, report plots, exported policy) before the job's limit.
#   STEPS=200 bash scripts/gpu_headline.sh                  (OUT=dir for the results; else bench/gpu_out)
#   SPAN=2 bash scripts/gpu_headline.sh; ATTACH=1 bash scripts/gpu_headline.sh
#                                                           (two back-to-back GPU calls: the first starts the run
#                                                           detached and returns before its limit, the run goes on
#                                                           on the warm machine, the second waits for it and collects)
#   RESUME=1 LAYERS=4 RESUME_STEPS=6 bash scripts/gpu_headline.sh
#   MAKE_ARGS="--test-body --vocab 3000 --device cpu" TRAIN_ARGS="model.device=cpu ..." bash scripts/gpu_headline.sh
#                                                           (the CPU rehearsal tests/train/test_gpu_headline.py runs)
# RESUME=1 instead proves a bitwise resume on the shape cut to LAYERS layers (full vocabulary, the same config,
# checkpoints on: 12 bytes per parameter, ~24 GiB at 4 layers, in /dev/shm): RESUME_STEPS steps straight vs
# RESUME_STEPS/2 (run.stop_at_step) + a resume in a new process, metrics and exported weights compared by
# `python -m rlalign.integrations.ray.compare` (every differing value, then "bitwise identical" or "NOT identical").
# Everything large lives in /dev/shm (the machine's disk is 64 GiB; a checkpoint of the full run's state is
# 91.5 GiB, so the headline run writes none). Results under $OUT: summary.txt, headline/ (metrics.jsonl,
# report.png, report.md, config.yaml, budget.md, train.log) or resume/ (both runs' metrics and the verdict).
source "$(dirname "$0")/gpu_common.sh" "Qwen3-8B headline (issue 17)"
DEADLINE=${DEADLINE:-570}; STEPS=${STEPS:-200}; RESUME=${RESUME:-0}; LAYERS=${LAYERS:-36}
SPAN=${SPAN:-1}; ATTACH=${ATTACH:-0}; GAP_S=${GAP_S:-30}   # calls the run spans; 1 on a later call; seconds between calls
LOAD_S=${LOAD_S:-60}     # seconds before the loop's clock starts: model load, engine, masters
END_S=${END_S:-75}       # after the loop stops: one more step past the guard, final eval, export, report, copies
CONFIG=configs/qwen3-8b-h200-device.yaml
[ -n "${ROOT:-}" ] || { ROOT=/tmp; [ -d /dev/shm ] && ROOT=/dev/shm; }
mkdir -p /tmp/bin; printf '#!/bin/sh\nexec %s -m rlalign.cli.main "$@"\n' "$PY" > /tmp/bin/rlalign; chmod +x /tmp/bin/rlalign
export PATH=/tmp/bin:$PATH
# fewer, larger free blocks for a job that uses ~130 of 139 GiB (CUDA graphs capture with it since torch 2.4)
export PYTORCH_CUDA_ALLOC_CONF=${ALLOC_CONF:-expandable_segments:True}
left() { echo $(( DEADLINE - $(elapsed) )); }

make_model() {   # make_model DIR LAYERS
  echo "[$(elapsed)s] model: qwen3-8b shape, $2 layers, random init -> $1" | tee -a "$SUMMARY"
  rm -rf "$1"
  # the config's checkpoint has a zero LM head (configs/qwen3-8b-h200-device.yaml, optim's comment); MAKE_ARGS replaces it
  $PY scripts/make_qwen3_8b.py "$1" --layers "$2" ${MAKE_ARGS---lm-head-std 0} 2>&1 | tail -3 | tee -a "$SUMMARY"
  [ -f "$1/config.json" ] || { echo "FAILED: no checkpoint in $1" | tee -a "$SUMMARY"; exit 1; }
}

copy_run() {   # copy_run RUN_DIR DEST
  mkdir -p "$2"
  [ -f "$1/report.md" ] || rlalign report "$1" > /dev/null 2>&1   # a run cut by the timeout wrote no report
  cp "$1"/metrics.jsonl "$1"/report.png "$1"/report.md "$1"/config.yaml "$2/" 2>/dev/null
}

if [ "$RESUME" = 1 ]; then
  [ "$LAYERS" = 36 ] && LAYERS=4
  N=${RESUME_STEPS:-6}; HALF=$(( N / 2 ))
  MODEL=$ROOT/q8b-$LAYERS; make_model "$MODEL" "$LAYERS"
  # no eval or checkpoint cadence of its own: evals at 0, every 2 steps and the last; checkpoints where a segment ends
  COMMON=(model.path="$MODEL" run.steps="$N" run.eval_every=2 run.save_checkpoints=true run.checkpoint_every=1000000
          run.keep_checkpoints=1 run.max_minutes=null run.progress=false ${TRAIN_ARGS:-})
  rm -rf "$ROOT/straight" "$ROOT/cut"
  echo "[$(elapsed)s] straight: $N steps" | tee -a "$SUMMARY"
  rlalign train "$CONFIG" "${COMMON[@]}" run.dir="$ROOT/straight" run.save_checkpoints=false 2>&1 | tail -4 | tee -a "$SUMMARY"
  echo "[$(elapsed)s] cut: steps 1-$HALF (run.stop_at_step=$HALF), checkpoint" | tee -a "$SUMMARY"
  rlalign train "$CONFIG" "${COMMON[@]}" run.dir="$ROOT/cut" run.stop_at_step="$HALF" 2>&1 | tail -4 | tee -a "$SUMMARY"
  echo "[$(elapsed)s] cut: resumed in a new process, steps $((HALF + 1))-$N" | tee -a "$SUMMARY"
  # no config file: the run directory's config.yaml is the run's (the file would lay its model.path over it)
  rlalign train run.dir="$ROOT/cut" run.resume=true run.stop_at_step=null 2>&1 | tail -4 | tee -a "$SUMMARY"
  copy_run "$ROOT/straight" "$OUT/resume/straight"; copy_run "$ROOT/cut" "$OUT/resume/cut"
  echo "[$(elapsed)s] metrics and final weights, straight vs cut + resumed:" | tee -a "$SUMMARY"
  $PY -m rlalign.integrations.ray.compare "$ROOT/straight" "$ROOT/cut" 2>&1 | tee "$OUT/resume/verdict.txt" | tee -a "$SUMMARY"
  rm -rf "$ROOT/straight" "$ROOT/cut" "$MODEL"
  echo "[$(elapsed)s] done" | tee -a "$SUMMARY"
  exit 0
fi

MODEL=$ROOT/q8b; RUN=$ROOT/q8b-run; DEST=$OUT/headline; LOG=$ROOT/q8b-train.log; PIDFILE=$ROOT/q8b-train.pid
mkdir -p "$DEST"

collect() {   # the run has ended: its log, metrics, plots and the summary lines under $OUT; scratch removed
  cp "$LOG" "$DEST/train.log" 2>/dev/null
  grep -v "^\s*$" "$DEST/train.log" | tail -8 | tee -a "$SUMMARY"
  copy_run "$RUN" "$DEST"
  cat "$DEST/report.md" 2>/dev/null | grep "^- " | tee -a "$SUMMARY"
  $PY - "$DEST/metrics.jsonl" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
steps = [r for r in rows if "mismatch/tokens" in r]
if steps:
    print(f"- compared log-probs {sum(r['mismatch/tokens'] for r in steps):,}, mismatches "
          f"{sum(r['mismatch/count'] for r in steps)}; peak GPU memory {max(r['memory/peak_mb'] for r in steps) / 1024:.1f} GiB; "
          f"median step {statistics.median(r['time/rollout_s'] + r['time/train_s'] for r in steps):.2f} s; "
          f"engine's weight copy {max(r['memory/engine_weight_copy_mb'] for r in steps):.0f} MiB (0: shared)")
EOF
  rm -rf "$RUN" "$MODEL" "$LOG" "$PIDFILE"
  echo "[$(elapsed)s] done" | tee -a "$SUMMARY"
}

wait_for_run() {   # wait_for_run KEEP_S: until the detached run ends or only KEEP_S seconds of this call are left
  local pid; pid=$(cat "$PIDFILE")
  while kill -0 "$pid" 2>/dev/null && [ "$(left)" -gt "$1" ]; do
    sleep 2
  done
  if kill -0 "$pid" 2>/dev/null; then
    echo "[$(elapsed)s] still running (pid $pid): $(grep ' step ' "$LOG" | tail -1 | cut -c1-120)" | tee -a "$SUMMARY"
    echo "NEXT: call again at once with ATTACH=1 (the machine must stay warm: it is given back after 30 s idle)" | tee -a "$SUMMARY"
    cp "$LOG" "$DEST/train.log" 2>/dev/null
    exit 0
  fi
}

if [ "$ATTACH" = 1 ]; then   # a later call of a SPAN > 1 run: wait for the detached run, then collect
  [ -f "$PIDFILE" ] || { echo "FAILED: no detached run on this machine ($PIDFILE missing: a fresh machine, or already collected)" | tee -a "$SUMMARY"; exit 1; }
  echo "[$(elapsed)s] attached to the detached run (pid $(cat "$PIDFILE"))" | tee -a "$SUMMARY"
  wait_for_run 25
  echo "[$(elapsed)s] the run has ended" | tee -a "$SUMMARY"
  collect
  exit 0
fi

make_model "$MODEL" "$LAYERS"
$PY -m rlalign.train.budget "$CONFIG" model.path="$MODEL" ${TRAIN_ARGS:-} | tee "$DEST/budget.md" | tail -4 | tee -a "$SUMMARY"
[ "${PIPESTATUS[0]}" = 0 ] || { echo "FAILED: the budget does not fit this device" | tee -a "$SUMMARY"; exit 1; }
# the time the run may take: SPAN calls of DEADLINE seconds, less what this one has used, the load, the end, and
# GAP_S per hand-over between calls
BUDGET_S=$(( SPAN * DEADLINE - $(elapsed) - LOAD_S - END_S - (SPAN - 1) * GAP_S ))
MAX_MIN=$($PY -c "print(round(max($BUDGET_S / 60, 0.5), 2))")
echo "[$(elapsed)s] strict GRPO, up to $STEPS steps, run.max_minutes=$MAX_MIN over $SPAN call(s) ($(left) s left in this one)" | tee -a "$SUMMARY"
rm -rf "$RUN" "$LOG"
# the hard stop keeps 20 s of the last call for collect(); metrics.jsonl is written step by step either way
HARD_S=$(( SPAN * DEADLINE - $(elapsed) - 20 - (SPAN - 1) * GAP_S ))
TRAIN=(timeout --signal=INT --kill-after=10 "$HARD_S" rlalign train "$CONFIG" model.path="$MODEL" run.dir="$RUN"
       run.steps="$STEPS" run.max_minutes="$MAX_MIN" run.progress=false ${TRAIN_ARGS:-})
if [ "$SPAN" = 1 ]; then
  "${TRAIN[@]}" > "$LOG" 2>&1
  echo "[$(elapsed)s] train exit status $? (124 or 130: cut by the job's time guard)" | tee -a "$SUMMARY"
  collect
  exit 0
fi
# SPAN > 1: the run outlives this call (a warm machine keeps processes and /dev/shm between calls: checked on the
# H200 in session 9); this call waits while it can, then a call with ATTACH=1 waits for the rest and collects
setsid nohup "${TRAIN[@]}" > "$LOG" 2>&1 < /dev/null &
echo $! > "$PIDFILE"
echo "[$(elapsed)s] detached: pid $(cat "$PIDFILE"), log $LOG" | tee -a "$SUMMARY"
wait_for_run "$([ "${FIRST_WAIT:-1}" = 1 ] && echo 15 || echo 999999)"   # FIRST_WAIT=0: return at once (tests)
echo "[$(elapsed)s] the run ended within this call" | tee -a "$SUMMARY"
collect
