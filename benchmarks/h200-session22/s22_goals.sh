#!/usr/bin/env bash
# Third device call: #9's H200 goals with the CUDA block-attention kernel (code as committed):
# the default pair (x16 HumanEval, 1,024 tokens, float32), the floor (a random 5-layer draft, x4,
# float32 target), and the replay at Qwen3.5-9B's shape (bf16 random weights, mean acceptance 6.5,
# head size 256 in its attention layers) at 1,024 and 4,096 tokens.
set -uo pipefail
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
R=$(mktemp -d)
mkdir -p $MLX_DFLASH_HOME/gguf
[ -f $MLX_DFLASH_HOME/gguf/smollm2-135m.gguf ] || cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype float32 2>&1 | tail -1); echo "model: $M"
bench() { timeout "$1" python3 -m mlx_dflash.cli bench "${@:2}" 2>&1 | tr '\r' '\n' | grep -E '^\||rror' ; }
echo "== default pair, x16, float32"
bench 200 --model "$M" --draft src/mlx_dflash/drafts/smollm2-135m --prompts .device/b/humaneval.jsonl \
  --num-prompts 16 --lengths 1024 --out "$R/default_x16_float32"
echo "== floor: a random draft, x4, float32"
python3 -c "
import json; from mlx_dflash.draft import create_random_draft, save_draft
save_draft(create_random_draft(json.load(open('$M/config.json')), num_layers=5, block_size=16, mask_token_id=16), '/tmp/random_draft')"
bench 90 --model "$M" --draft /tmp/random_draft --prompts .device/b/humaneval.jsonl --num-prompts 4 --lengths 1024 \
  --out "$R/floor_x4_float32"
echo "== Qwen3.5-9B shape, replay 6.5"
bench 230 --scale qwen3.5-9b --lengths 1024 4096 --num-prompts 1 --replay-mean 6.5 --out "$R/q35_9b_replay"
tar czf "$OUT/goals.tgz" -C "$R" .
