#!/usr/bin/env bash
# Issues 16/17 on one H200 in one call: the rollout roofline benchmark (strict and native, both with decode
# graphs, and transformers generate; --verify against the trainer) and the training-step benchmark on
# Qwen3-8B shapes (strict, native, stock transformers). Each step under its own time limit.
#   bash scripts/gpu_perf.sh              WORKLOAD=0.6b-ctx512 TRAIN_LAYERS=6 ROLL_SECONDS=300 TRAIN_SECONDS=200
source "$(dirname "$0")/gpu_common.sh" "GPU perf (rollout roofline, training step)"
WORKLOAD=${WORKLOAD:-0.6b-ctx512}
echo "== rollout $WORKLOAD (t=$(elapsed)s)"
timeout "${ROLL_SECONDS:-300}" $PY -m rlalign.cli.main bench rollout --device cuda --workload "$WORKLOAD" --verify --json \
  ${ROLL_ARGS:-} > "$OUT/rollout_$WORKLOAD.json" 2> "$OUT/rollout_$WORKLOAD.err"
echo "rollout rc=$? (124 = timed out)" | tee -a "$SUMMARY"
tail -n 5 "$OUT/rollout_$WORKLOAD.err"
$PY - "$OUT/rollout_$WORKLOAD.json" <<'PYEOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
keys = ("tokens_per_s", "decode_step_ms", "forward_gpu_ms", "host_ms_per_step", "achieved_gbps", "roofline_fraction",
        "forward_roofline_fraction", "logprob_mismatches", "decode_graphs", "graph_captures_timed")
for x in r["rows"]:
    print(x.get("profile", x["engine"]), {k: x[k] for k in keys if k in x})
print("ratios", r.get("ratios"))
PYEOF
if [ "${TRAIN_LAYERS:-6}" != 0 ]; then
  echo "== train step, 8B shape x ${TRAIN_LAYERS:-6} layers (t=$(elapsed)s)"
  timeout "${TRAIN_SECONDS:-200}" $PY bench/train_step.py --device cuda --layers "${TRAIN_LAYERS:-6}" \
    --out "$OUT/train_step_${TRAIN_LAYERS:-6}l.json" 2>&1 | tail -n 12 | tee -a "$SUMMARY"
fi
echo "done (t=$(elapsed)s)" | tee -a "$SUMMARY"
