#!/usr/bin/env bash
# launcher=ray on GPUs, compared bit for bit with the single-process GPU run (not run in CI: no GPU there).
#   bash scripts/ray_gpu_check.sh [OUT_DIR]
# Needs `ray` importable (pip install -e '.[ray]'). With 3+ GPUs it checks the NCCL broadcast path (trainer +
# 2 workers, one GPU each); with 1 GPU the object-store path with the three actors sharing it.
set -euo pipefail
out=${1:-${OUT:-/tmp/ray_gpu_check}}
export RAY_AUTH_MODE=disabled
python -c "import ray" || { echo "ray is not installed: pip install -e '.[ray]'"; exit 2; }
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
common=(model.device=cuda run.steps=${STEPS:-5} run.eval_every=5 run.progress=false)
rlalign train "${common[@]}" run.dir="$out/local"
if [ "$gpus" -ge 3 ]; then
  rlalign train "${common[@]}" launcher=ray ray.num_rollout_workers=2 ray.gpus_per_actor=1 \
    ray.weight_sync=broadcast run.dir="$out/ray_nccl"
  python -m rlalign.integrations.ray.compare "$out/local" "$out/ray_nccl"
fi
rlalign train "${common[@]}" launcher=ray ray.num_rollout_workers=2 ray.gpus_per_actor=0.3 \
  ray.weight_sync=object_store run.dir="$out/ray_object_store"
python -m rlalign.integrations.ray.compare "$out/local" "$out/ray_object_store"
