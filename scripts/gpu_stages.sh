#!/usr/bin/env bash
# One device call made of named stages, each under its own time limit, results under $OUT/<stage>*.
# The lead's tool for batching a build-check-benchmark into one H200 call (docs/gpu.md, "Running it").
#   STAGES="ws tests train roll" bash scripts/gpu_stages.sh
# Stages and their knobs (environment variables, defaults in brackets):
#   ws      bench/gpu_linear.py --sweep-ws $WS_ARGS                WS_ARGS [] WS_S [120]
#   kpart   bench/gpu_linear.py --sweep-kpart                      KP_S [150]
#   linear  bench/gpu_linear.py --set $LIN_SET (kernel, op, graph replays of both) LIN_SET [segments] LIN_S [150]
#   tests   pytest -n 8 --dist load on TESTS [tests/cuda]            TESTS_S [150]
#   train   bench/train_step.py --profile-kernels                  TR_LAYERS [6] TR_VARIANTS [strict,native,transformers]
#                                                                  TR_ARGS [] TR_S [200]
#   census  bench/gemm_census.py --layers 6                        CENSUS_S [180]
#   attn    bench/gpu_attention.py $ATTN_ARGS [--sweep-train]      ATTN_S [150]
#   roll    rlalign bench rollout per workload in ROLL [0.6b-ctx512] ROLL_ENGINES [strict] ROLL_ARGS [] ROLL_S [240]
source "$(dirname "$0")/gpu_common.sh" "stages: ${STAGES:-}"
{ echo "tree $(git rev-parse --short HEAD 2>/dev/null) + worktree (the device's git metadata can be stale)"; } >> "$SUMMARY"

run_stage() {   # name seconds command...: run with a limit, log to $OUT/<name>.log, rc and tail into the summary
  local name=$1 secs=$2; shift 2
  echo "== $name (t=$(elapsed)s)" | tee -a "$SUMMARY"
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "rc=$? (124 = timed out)" | tee -a "$SUMMARY"
}

for stage in ${STAGES:-}; do
  case $stage in
    ws)
      # shellcheck disable=SC2086
      run_stage ws "${WS_S:-120}" $PY bench/gpu_linear.py --sweep-ws ${WS_ARGS:-} --out "$OUT/ws"
      tail -n 30 "$OUT/ws.log" >> "$SUMMARY" ;;
    kpart)
      run_stage kpart "${KP_S:-150}" $PY bench/gpu_linear.py --sweep-kpart --out "$OUT/kpart"
      tail -n 40 "$OUT/kpart.log" >> "$SUMMARY" ;;
    linear)
      run_stage linear "${LIN_S:-150}" $PY bench/gpu_linear.py --set "${LIN_SET:-segments}" --out "$OUT/linear"
      tail -n 30 "$OUT/linear.log" >> "$SUMMARY" ;;
    tests)
      # shellcheck disable=SC2086
      run_stage tests "${TESTS_S:-150}" $PY -m pytest -q -n 8 --dist load ${TESTS:-tests/cuda} -x -p no:cacheprovider
      grep -E "passed|failed|error|FAILED|ERROR" "$OUT/tests.log" | tail -n 25 >> "$SUMMARY" ;;
    train)
      # shellcheck disable=SC2086
      run_stage train "${TR_S:-200}" $PY bench/train_step.py --device cuda --layers "${TR_LAYERS:-6}" \
        --variants "${TR_VARIANTS:-strict,native,transformers}" --profile-kernels ${TR_ARGS:-} --out "$OUT/train_step_${TR_LAYERS:-6}l.json"
      grep -B2 -A14 "^train step" "$OUT/train.log" | head -n 20 >> "$SUMMARY" ;;
    census)
      run_stage census "${CENSUS_S:-180}" $PY bench/gemm_census.py --device cuda --layers 6 --out "$OUT/census"
      tail -n 45 "$OUT/census.log" >> "$SUMMARY" ;;
    attn)
      # shellcheck disable=SC2086
      run_stage attn "${ATTN_S:-150}" $PY bench/gpu_attention.py ${ATTN_ARGS:---sweep-train} --out "$OUT/attn"
      tail -n 40 "$OUT/attn.log" >> "$SUMMARY" ;;
    roll)
      for w in ${ROLL:-0.6b-ctx512}; do
        # shellcheck disable=SC2086
        run_stage "roll_$w" "${ROLL_S:-240}" $PY -m rlalign.cli.main bench rollout --device cuda --workload "$w" \
          --engines "${ROLL_ENGINES:-strict}" --verify --json ${ROLL_ARGS:-}
        # the JSON is the log's last line; stderr lines precede it
        $PY - "$OUT/roll_$w.log" <<'PYEOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
lines = [l for l in open(sys.argv[1]) if l.startswith("{")]
if not lines:
    print("no JSON result"); raise SystemExit
r = json.loads(lines[-1])
keys = ("tokens_per_s", "decode_step_ms", "decode_step_ms_median", "decode_step_ms_max", "forward_gpu_ms", "host_ms_per_step", "achieved_gbps", "roofline_fraction", "op_floor_ms", "op_roofline_fraction",
        "logprob_mismatches", "logprob_tokens_checked")
for x in r["rows"]:
    print(x.get("profile", x["engine"]), {k: x[k] for k in keys if k in x})
    prof = x.get("kernel_profile")
    if isinstance(prof, dict):
        print("  families", prof.get("families"))
print("ratios", r.get("ratios"))
PYEOF
      done ;;
    *) echo "unknown stage $stage" | tee -a "$SUMMARY" ;;
  esac
done
echo "== done (t=$(elapsed)s)" | tee -a "$SUMMARY"
