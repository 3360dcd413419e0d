#!/usr/bin/env bash
# One device call (< 10 min on one H200): the CUDA test suite, `rlalign doctor --device cuda`, and the
# strict training step of configs/gpu-grpo-200.yaml (Qwen3-0.6B-shaped body, bf16) measured for this tree
# and, when OLD_TREE names an older checkout of the repository, for that one too (before/after numbers).
#
#   OLD_TREE=.old bash scripts/gpu_check.sh        # results to $OUT (the device tool's folder), else bench/gpu_out
#
# Files: cuda_tests.log, doctor_cuda.json, step_<name>.jsonl (each run's metrics), summary.txt.
source "$(dirname "$0")/gpu_common.sh" "GPU check"
XDIST=""; $PY -c "import xdist" 2>/dev/null && XDIST="-n 8 --dist loadfile"
echo "== cuda tests (t=$(elapsed)s)"
timeout 300 $PY -m pytest tests -m cuda -q -rfE -p no:cacheprovider $XDIST > "$OUT/cuda_tests.log" 2>&1
echo "cuda tests rc=$? : $(grep -E '[0-9]+ (passed|failed)' "$OUT/cuda_tests.log" | tail -1)" | tee -a "$SUMMARY"
grep -E "^(FAILED|ERROR)" "$OUT/cuda_tests.log" | head -20 | tee -a "$SUMMARY"
echo "== doctor (t=$(elapsed)s)"
timeout 120 $PY -m rlalign.cli.main doctor --device cuda --json > "$OUT/doctor_cuda.json" 2>&1
echo "doctor rc=$?" | tee -a "$SUMMARY"

MODEL=/tmp/m06
[ -f $MODEL/config.json ] || timeout 120 $PY scripts/shaped_model.py qwen3-0.6b $MODEL --tokenizer default > /dev/null 2>&1
STEP_ARGS="model.path=$MODEL run.steps=${STEPS:-12} run.eval_every=1000 run.checkpoint_every=1000 run.progress=false"
train_step() {  # name, tree, extra overrides...
  local name=$1 tree=$2; shift 2
  echo "== train $name (t=$(elapsed)s)"
  ( cd "$tree" && PYTHONPATH="$PWD" timeout 200 $PY -m rlalign.cli.main train configs/gpu-grpo-200.yaml $STEP_ARGS \
      run.dir=/tmp/run_$name "$@" > "/tmp/train_$name.log" 2>&1 ); echo "train $name rc=$?" | tee -a "$SUMMARY"
  tail -n 3 "/tmp/train_$name.log"
  cp /tmp/run_$name/metrics.jsonl "$OUT/step_$name.jsonl" 2>/dev/null
}
[ -n "${OLD_TREE:-}" ] && train_step before "$OLD_TREE"
train_step after . optim.master_weights=false
train_step after_master .
$PY - "$OUT" <<'PYEOF' 2>&1 | tee -a "$SUMMARY"
import glob, json, os, statistics, sys
for path in sorted(glob.glob(os.path.join(sys.argv[1], "step_*.jsonl"))):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    steps = [r for r in rows if "time/train_s" in r][2:]          # skip compilation / warm-up steps
    if not steps:
        print(os.path.basename(path), "no steps"); continue
    tr = [r["time/train_s"] for r in steps]; ro = [r["time/rollout_s"] for r in steps]
    mism = sum(r.get("mismatch/count", 0) for r in rows); toks = sum(r.get("mismatch/tokens", 0) for r in rows)
    print(f"{os.path.basename(path)}: train step median {statistics.median(tr):.3f} s [{min(tr):.3f}-{max(tr):.3f}], "
          f"rollout median {statistics.median(ro):.3f} s, {len(steps)} steps, mismatches {mism} of {toks}")
PYEOF
echo "total $(elapsed)s" | tee -a "$SUMMARY"
