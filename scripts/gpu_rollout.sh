#!/usr/bin/env bash
# Rollout engine on one GPU, in one device call: the CUDA rollout/graph tests, then the rollout
# benchmark (strict with decode graphs, strict eager, native, transformers generate), each step under
# its own time limit. Results to $OUT (the device tool's folder), else bench/gpu_out.
#
#   bash scripts/gpu_rollout.sh                      # tests + 64 x 8 x 256 comparison
#   ROLLOUT_FULL=1 bash scripts/gpu_rollout.sh       # also the issue's 256 x 8 x 512 workload
#
# Files: rollout_tests.log, rollout_*.json, summary.txt.
source "$(dirname "$0")/gpu_common.sh" "GPU rollout"

if [ -z "${SKIP_TESTS:-}" ]; then
  echo "== tests (t=$(elapsed)s)"
  timeout "${TEST_SECONDS:-240}" $PY -m pytest -q -rfE -p no:cacheprovider ${TESTS:-tests/rollout/test_decode_graphs.py} \
    > "$OUT/rollout_tests.log" 2>&1
  echo "tests rc=$? (124 = timed out)" | tee -a "$SUMMARY"
  tail -n 25 "$OUT/rollout_tests.log"
fi

bench() {  # name, time limit (s), bench args...
  local name=$1 limit=$2; shift 2
  echo "== bench $name (t=$(elapsed)s): $*"
  timeout "$limit" $PY bench/rollout.py --device cuda --json "$@" > "$OUT/rollout_$name.json" 2> "$OUT/rollout_$name.err"
  echo "bench $name rc=$? (124 = timed out)" | tee -a "$SUMMARY"
  tail -n 3 "$OUT/rollout_$name.err"
  $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print(json.dumps({x['profile'] if x['engine']=='rlalign' else x['engine']: {k: x[k] for k in ('tokens_per_s','seconds','graph_steps','logprob_mismatches','steps') if k in x} for x in r['rows']}), r['ratios'])" \
    "$OUT/rollout_$name.json" 2>&1 | tee -a "$SUMMARY"
}
bench small ${SMALL_SECONDS:-200} --prompts 64 --new-tokens 256 --verify ${SMALL_ARGS:-}
if [ -n "${ROLLOUT_FULL:-}" ]; then
  bench full ${FULL_SECONDS:-300} --hf-prompts 64 --verify ${FULL_ARGS:-}
fi
echo "done (t=$(elapsed)s)"
