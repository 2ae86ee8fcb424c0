#!/usr/bin/env bash
# Benchmarks on the lent H200 (MLX CUDA): the default pair on HumanEval, and scale mode.
# Same staging as train_default_draft.sh, plus .device/b/humaneval.jsonl
# (python -m mlx_dflash.bench_prompts > .device/b/humaneval.jsonl).
# DRAFT: a draft folder (default: the one trained by train_default_draft.sh if this machine
# still has it, else the shipped one).
set -uo pipefail
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
mkdir -p $MLX_DFLASH_HOME/gguf
[ -f $MLX_DFLASH_HOME/gguf/smollm2-135m.gguf ] || cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype bfloat16 2>&1 | tail -1
D=${DRAFT:-/tmp/work/run/draft}; [ -d "$D" ] || D=src/mlx_dflash/drafts/smollm2-135m
echo "draft: $D"
nvidia-smi --query-gpu=name --format=csv,noheader; python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
quiet() { tr '\r' '\n' | grep -v '^bench: .*run/s\]$'; }
python3 -m mlx_dflash.cli bench --model smollm2-135m --draft "$D" --prompts .device/b/humaneval.jsonl \
  --num-prompts "${NUM_PROMPTS:-10}" --lengths ${LENGTHS:-256 1024} --out "$OUT/default" 2>&1 | quiet | tail -12
python3 -m mlx_dflash.cli bench --scale qwen3-8b --lengths 1024 --num-prompts 1 --replay-mean 6.5 1 \
  --out "$OUT/scale" 2>&1 | quiet | tail -12
