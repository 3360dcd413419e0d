#!/usr/bin/env bash
# The Triton backend's GPU suite in one call (the tests took > 170 s at -n 8 on 2026-12-01: 282 of them): the CUDA test suite, then each
# benchmark, every step under its own time limit so that one failure never stops the rest.
#
#   bash scripts/gpu_suite.sh            # results to $OUT (the device tool's folder), else bench/gpu_out
#
# Files written (8): cuda_tests.log, bench_{linear,attention,logprob}.{csv,json}, summary.txt.
# The summary table is printed last.
source "$(dirname "$0")/gpu_common.sh" "GPU suite"

# ---- 1. CUDA tests: one pytest worker per file (compilation runs in parallel; a crash stays in its file)
TEST_ARGS=(tests/cuda -q -rfE -p no:cacheprovider)
if $PY -c "import pytest_timeout" 2>/dev/null; then TEST_ARGS+=(--timeout 200); fi
if $PY -c "import xdist" 2>/dev/null; then TEST_ARGS+=(-n 8 --dist loadfile -v); fi
echo "== cuda tests (t=$(elapsed)s): pytest ${TEST_ARGS[*]}"
timeout 420 $PY -m pytest "${TEST_ARGS[@]}" > "$OUT/cuda_tests.log" 2>&1
TEST_RC=$?
tail -n 40 "$OUT/cuda_tests.log"
echo "cuda tests rc=$TEST_RC (124 = timed out)" | tee -a "$SUMMARY"

# ---- 2. benchmarks, one process each (a GPU fault in one cannot poison the next)
run_bench() {  # name, time limit (s)
  echo "== bench $1 (t=$(elapsed)s)"
  timeout "$2" $PY "bench/gpu_$1.py" --out "$OUT" 2>&1 | tail -n 60
  local rc=${PIPESTATUS[0]}
  echo "bench $1 rc=$rc (124 = timed out)" | tee -a "$SUMMARY"
}
run_bench linear 140
run_bench attention 75
run_bench logprob 90

# ---- 3. summary table (also to summary.txt)
echo "== summary (t=$(elapsed)s)"
$PY - "$OUT" <<'EOF' 2>&1 | tee -a "$SUMMARY"
import json, os, re, sys
out = sys.argv[1]
log = open(os.path.join(out, "cuda_tests.log")).read() if os.path.exists(os.path.join(out, "cuda_tests.log")) else ""
m = re.findall(r"^=*\s*(\d+ (?:passed|failed|errors?|skipped).*?) in [\d.]+s", log, re.M)
print("CUDA tests:", m[-1] if m else "no pytest summary line (see cuda_tests.log)")
for line in log.splitlines():
    if line.startswith(("FAILED", "ERROR")):
        print("  " + line[:160])
def load(name):
    p = os.path.join(out, f"bench_{name}.json")
    return json.load(open(p)) if os.path.exists(p) else None
lin = load("linear")
if lin:
    e = lin["env"]
    print(f"\n{e['gpu']} | torch {e['torch']} | triton {e['triton']} | {e['date']}")
    print("linear (strict / cuBLAS speed; target >= 0.95 at M >= 4096, >= 0.9 at M >= 1024 and M <= 64):")
    print(f"  {'N x K':>13} " + " ".join(f"{'M=' + str(m):>8}" for m in (1, 16, 64, 1024, 4096, 16384)))
    for (n, k) in ((4096, 4096), (12288, 4096), (4096, 12288), (151936, 4096)):
        cells = []
        for mm in (1, 16, 64, 1024, 4096, 16384):
            r = [x for x in lin["rows"] if x.get("N") == n and x.get("K") == k and x.get("M") == mm
                 and x.get("k_segments") == 1 and not x.get("sweep")]
            cells.append(("ERR" if "error" in r[0] else f"{r[0]['ratio']:.2f}") if r else "-")
        print(f"  {str(n) + 'x' + str(k):>13} " + " ".join(f"{c:>8}" for c in cells))
    seg = [x for x in lin["rows"] if x.get("k_segments", 1) > 1 and not x.get("sweep") and "ratio" in x]
    if seg:
        print("  k_segments=8: " + ", ".join(f"{x['N']}x{x['K']} M={x['M']}: {x['ratio']:.2f}" for x in seg))
    sw = [x for x in lin["rows"] if x.get("sweep") and "strict_tflops" in x]
    if sw:
        print("  tile sweep at M=4096 (TFLOP/s): " + ", ".join(f"{x['N']}x{x['K']}/seg{x['k_segments']} {x['config']}: {x['strict_tflops']}" for x in sw))
att = load("attention")
if att:
    print("attention (SDPA time / ours; target >= 0.8):")
    for r in att["rows"]:
        if "error" in r:
            print(f"  {r.get('kind')}: ERROR {r['error'][:100]}")
        else:
            extra = f"page {r['page']}" if "page" in r else ""
            print(f"  {r['kind']:>14} B={r['batch']:<3} seq={r['seq']:<5} {r['hq']}/{r['hkv']} {extra:>8}: "
                  f"ours {r['ours_ms']} ms, {r['baseline']} {r['base_ms']} ms, ratio {r['ratio']}")
lp = load("logprob")
if lp:
    print("logprob (T=16384, H=4096, V=151936; target time <= 1.1x, memory <= 0.1x naive):")
    for r in lp["rows"]:
        if "error" in r:
            print(f"  {r['case']}: ERROR {r['error'][:100]}")
        elif "value" in r:
            print(f"  {r['case']}: {r['value']:.3g}")
        else:
            print(f"  {r['case']:>24}: {r['ms']} ms, peak {r['peak_gib']} GiB"
                  + (f", time x{r['time_ratio']}, mem x{r['mem_ratio']}" if "time_ratio" in r else ""))
EOF
echo "total $(elapsed)s" | tee -a "$SUMMARY"
