#!/usr/bin/env bash
# Trains the shipped draft for SmolLM2-135M-Instruct on the lent H200 (MLX CUDA).
# Staging (from the checkout root, see ../shared/device/README.md):
#   bash ../shared/device/stage-mlx-cuda ~/.cache/mlx-dflash/gguf/smollm2-135m.gguf
#   device calls: .device/a keep.sh, .device/c keep.sh, then carry .device/b and run this script.
# Knobs (env): PROMPTS, DATA_SECONDS, TRAIN_SECONDS, LAYERS.
set -uo pipefail
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
W=/tmp/work; mkdir -p $W $MLX_DFLASH_HOME/gguf
cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/smollm2-135m.gguf
python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype bfloat16 2>&1 | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
# 1. self-distillation data (resumable: a timeout keeps what is written)
time timeout "${DATA_SECONDS:-200}" python3 -m mlx_dflash.cli data --model smollm2-135m --out $W/data \
  --num-prompts "${PROMPTS:-6000}" --max-tokens 384 --batch-size 256 2>&1 | tr '\r' '\n' | grep -v '^responses: .*prompt/s\]$' | tail -3
echo "sequences: $(wc -l < $W/data/sequences.jsonl)"
# 2. train within a time budget, then measure held-out acceptance
time python3 -m mlx_dflash.cli train --model smollm2-135m --data $W/data --out $W/run --layers "${LAYERS:-3}" \
  --steps 20000 --batch-size 16 --anchors 256 --max-len 768 --eval-every 0 --eval-prompts 16 --save-every 200 \
  --time-budget "${TRAIN_SECONDS:-300}" 2>&1 | tr '\r' '\n' | grep -v '^train: .*step/s' | tail -6
# the shipped form: bfloat16, in <=15 MB pieces (files back from the machine are capped at 16 MB)
python3 -c "
import mlx.core as mx; from mlx_dflash.draft import load_draft, save_draft
save_draft(load_draft('$W/run/draft', dtype=mx.bfloat16), '$W/ship')"
split -b 15M $W/ship/model.safetensors "$OUT"/model.safetensors.part.
cp $W/ship/config.json $W/run/training.png $W/run/history.json "$OUT"/
gzip -c $W/data/sequences.jsonl > "$OUT"/sequences.jsonl.gz
ls -la "$OUT"
