#!/usr/bin/env bash
# the bench with its warm-up over the longest length: Qwen3.5-9B replay, then the default pair
set -uo pipefail
source .device/b/env.sh >/dev/null
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
quiet() { tr '\r' '\n' | grep -E '^\||^\{|error|Error'; }
time python3 -m mlx_dflash.cli bench --scale qwen3.5-9b --lengths 1024 4096 --num-prompts 1 --replay-mean 6.5 \
  --out $OUT/q35_9b_replay 2>&1 | quiet
mkdir -p /tmp/mlxd/gguf; cp $DEVICE_FILES/smollm2-135m.gguf /tmp/mlxd/gguf/ 2>/dev/null
M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype bfloat16 2>/dev/null | tail -1)
time python3 -m mlx_dflash.cli bench --model $M --draft src/mlx_dflash/drafts/smollm2-135m --prompts .device/b/humaneval.jsonl \
  --num-prompts 4 --lengths 1024 --out $OUT/default_x4_1024 2>&1 | quiet
