# Sourced by the scripts/gpu_*.sh device scripts: repository root, $OUT, Python, a summary file that
# starts with the machine and versions, and elapsed() for per-step timestamps.
#   source "$(dirname "$0")/gpu_common.sh" "title"
set -u
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${OUT:-bench/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
SUMMARY="$OUT/summary.txt"
START=$(date +%s)
elapsed() { echo $(( $(date +%s) - START )); }
{
  echo "# rlalign $1  $(date -Is)"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv,noheader 2>&1 | head -2
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], '| torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.version.cuda)" 2>&1
  git log -1 --format='commit %h %s' 2>/dev/null || true
} | tee "$SUMMARY"
