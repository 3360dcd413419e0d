#!/usr/bin/env bash
# One H200 call that checks a change set end to end: the CUDA tier (bitwise and accuracy tests), then the
# benchmarks a kernel or engine change moves, each under its own time limit (seconds), results in $OUT.
#   bash scripts/gpu_verify.sh     TEST_SECONDS=300 TESTS="tests/cuda" WORKERS=12 MOE=40 LINEAR=40 ATTN=60 ROLL=150 TRAIN=60
#   ROLL_ARGS="--profile-kernels" TRAIN_ARGS="--profile-kernels": where the step time goes, by kernel family
# A stage with limit 0 is skipped. The rollout stage runs strict and native (both with decode graphs) on
# ROLL_WORKLOAD with --verify; the training stage the strict and native 8B-shape step.
source "$(dirname "$0")/gpu_common.sh" "verify (CUDA tier + benchmarks)"
DEFAULT_TESTS="tests/cuda tests/rollout/test_decode_graphs.py tests/ops/test_native_decode.py tests/rollout/test_engine_routing.py"
stage() { echo "== $1 (t=$(elapsed)s)" | tee -a "$SUMMARY"; }
if [ "${TEST_SECONDS:-300}" != 0 ]; then
  stage "CUDA tests: ${TESTS:-$DEFAULT_TESTS}"
  PER_TEST=(); $PY -c "import pytest_timeout" 2>/dev/null && PER_TEST=(--timeout 200)
  timeout "${TEST_SECONDS:-300}" $PY -m pytest -v -n "${WORKERS:-12}" --dist load -p no:cacheprovider -rfE "${PER_TEST[@]}" \
    ${TESTS:-$DEFAULT_TESTS} > "$OUT/cuda_tests.log" 2>&1
  echo "pytest rc=$? (124 = timed out)" | tee -a "$SUMMARY"
  grep -E "FAILED|ERROR|passed|failed" "$OUT/cuda_tests.log" | tail -n 25 | tee -a "$SUMMARY"
fi
if [ "${MOE:-40}" != 0 ]; then
  stage "MoE experts, route + combine (bench/gpu_moe.py --backward)"
  timeout "${MOE:-40}" $PY bench/gpu_moe.py --backward --out "$OUT/moe" 2>&1 | grep -E '"(ffn|route_combine)"' \
    | tee -a "$SUMMARY"
fi
if [ "${LINEAR:-40}" != 0 ]; then
  stage "K-partition GEMMs (bench/gpu_linear.py --set segments)"
  timeout "${LINEAR:-40}" $PY bench/gpu_linear.py --set segments --out "$OUT/linear" 2>&1 | grep -vE "^\{|^\s*$" \
    | tail -n 12 | tee -a "$SUMMARY"
fi
if [ "${ATTN:-60}" != 0 ]; then
  stage "attention (bench/gpu_attention.py)"
  timeout "${ATTN:-60}" $PY bench/gpu_attention.py --out "$OUT/attention" ${ATTN_ARGS:-} 2>&1 | grep -vE "^\{|^\s*$" \
    | tail -n 30 | tee -a "$SUMMARY"
fi
if [ "${ROLL:-150}" != 0 ]; then
  W=${ROLL_WORKLOAD:-0.6b-ctx512}
  stage "rollout $W (strict, native; --verify)"
  timeout "${ROLL:-150}" $PY -m rlalign.cli.main bench rollout --device cuda --workload "$W" --engines strict,native \
    --verify --json ${ROLL_ARGS:-} > "$OUT/rollout_$W.json" 2> "$OUT/rollout_$W.err"
  echo "rollout rc=$?" | tee -a "$SUMMARY"; tail -n 3 "$OUT/rollout_$W.err"
  $PY - "$OUT/rollout_$W.json" <<'PYEOF' 2>&1 | tee -a "$SUMMARY"
import json, sys
r = json.load(open(sys.argv[1]))
for x in r["rows"]:
    print(x.get("profile", x["engine"]), {k: v for k, v in x.items() if k not in ("engine", "profile") and not isinstance(v, (list, dict))})
print("ratios", r.get("ratios"))
PYEOF
fi
if [ "${TRAIN:-60}" != 0 ]; then
  stage "training step, 8B shape x 6 layers"
  timeout "${TRAIN:-60}" $PY bench/train_step.py --device cuda --layers 6 --variants strict,native \
    --out "$OUT/train_step_6l.json" ${TRAIN_ARGS:-} 2>&1 | tail -n 8 | tee -a "$SUMMARY"
fi
stage done
