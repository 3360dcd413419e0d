#!/usr/bin/env bash
# Short strict GRPO probes of the Qwen3-8B headline config (issue 17.5), one after another in ONE GPU job, to pick
# the config of the 200-step run: each probe is scripts/gpu_headline.sh on its own checkpoint and overrides, cut
# at PROBE_STEPS (run.stop_at_step), no evaluation, and stopped early when it freezes (run.stop_when_stalled).
#   PROBES="name|make args|train overrides;..." PROBE_STEPS=60 bash scripts/gpu_learn_sweep.sh
#   e.g. PROBES="head002|--lm-head-std 0.002|optim.lr=5e-5;head0|--lm-head-std 0|optim.lr=5e-5"
# Every probe gets an equal share of the job's DEADLINE (seconds) less what the earlier ones used. Results under
# $OUT/<name>/ (headline/metrics.jsonl, report.png, train.log, summary.txt) and one table per probe in
# $OUT/sweep.txt: reward, entropy, the fraction of groups with identical samples at a few steps.
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-bench/gpu_out}; DEADLINE=${DEADLINE:-570}; PROBE_STEPS=${PROBE_STEPS:-60}; PY=${PYTHON:-python3}
START=$(date +%s); mkdir -p "$OUT"
IFS=';' read -r -a SPECS <<< "${PROBES:?set PROBES=\"name|make args|train overrides;...\"}"
n=${#SPECS[@]}; i=0
for spec in "${SPECS[@]}"; do
  IFS='|' read -r name make train <<< "$spec"
  used=$(( $(date +%s) - START )); share=$(( (DEADLINE - used) / (n - i) )); i=$(( i + 1 ))
  echo "[$used s] probe $i/$n $name: make '$make', train '$train', $share s" | tee -a "$OUT/sweep.txt"
  OUT="$OUT/$name" DEADLINE=$share STEPS=200 LOAD_S=45 END_S=25 MAKE_ARGS="$make" \
    TRAIN_ARGS="run.stop_at_step=$PROBE_STEPS run.eval_every=100000 run.stop_when_stalled=8 $train" \
    bash scripts/gpu_headline.sh > "$OUT/$name.log" 2>&1
  $PY - "$OUT/$name/headline/metrics.jsonl" <<'PYEOF' 2>&1 | tee -a "$OUT/sweep.txt"
import json, sys
try:
    rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
except OSError as e:
    sys.exit(f"  no metrics ({e})")
steps = [r for r in rows if "reward/mean" in r and "mismatch/count" in r]
marks = {1, 5, 10, 15, 20, 25, 30, 40, 50, 60, 80, 100, 150, 200}
for r in steps:
    if r["step"] in marks or r is steps[-1]:
        print(f"  step {r['step']:>3}  reward {r['reward/mean']:8.3f}  entropy {r.get('entropy', float('nan')):7.3f}"
              f"  grad {r.get('grad_norm', float('nan')):6.2f}  identical groups {r.get('reward/zero_std_frac', float('nan')):.2f}  mismatches {r['mismatch/count']}")
PYEOF
done
echo "[$(( $(date +%s) - START )) s] sweep done" | tee -a "$OUT/sweep.txt"
