#!/usr/bin/env bash
# TF32: MLX CUDA's float32 matmuls; does MLX_ENABLE_TF32=0 give exact float32 (tests, token match)?
set -uo pipefail
source .device/b/env.sh >/dev/null
export PYTHONPATH=$PWD/src:$PYTHONPATH MLX_DFLASH_HOME=/tmp/mlxd PYTHONUNBUFFERED=1
mkdir -p /tmp/mlxd/gguf; cp -n $DEVICE_FILES/smollm2-135m.gguf /tmp/mlxd/gguf/
MLX_ENABLE_TF32=0 python3 -m pytest -p no:cacheprovider -o addopts="" -q tests/test_delta_rule.py 2>&1 | grep -E "FAILED|passed|failed"
M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype float32 2>/dev/null | tail -1); echo $M
D=src/mlx_dflash/drafts/smollm2-135m
for tf in 1 0; do
  echo "== float32, MLX_ENABLE_TF32=$tf"
  MLX_ENABLE_TF32=$tf python3 -m mlx_dflash.cli bench --model $M --draft $D --prompts .device/b/humaneval.jsonl \
    --num-prompts 8 --lengths 1024 --out $OUT/f32_tf32_$tf 2>&1 | grep -E '^\||error'
done
