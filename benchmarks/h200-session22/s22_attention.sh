#!/usr/bin/env bash
# One device call: the CUDA block-attention kernel's tests on the GPU, a cycle's pieces with the
# kernel and without (scripts/launch_costs.py, the float32 target), then the default pair (x16
# HumanEval, 1,024 tokens, float32) as committed and with the kernel off (scripts/device/ab.sh,
# ROUNDS rounds; the patch is cuda_attention_off.patch beside this file, carried in .device/patches).
set -uo pipefail
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
nvidia-smi --query-gpu=name --format=csv,noheader
if [ -z "${SKIP_TESTS:-}" ]; then
  timeout 200 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rs tests/test_cuda_attention.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
fi
mkdir -p $MLX_DFLASH_HOME/gguf
[ -f $MLX_DFLASH_HOME/gguf/smollm2-135m.gguf ] || cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype float32 2>&1 | tail -1); echo "model: $M"
D=src/mlx_dflash/drafts/smollm2-135m
if [ -z "${SKIP_COSTS:-}" ]; then
  for use in True False; do
    echo "== launch costs, USE_CUDA_ATTENTION=$use"
    timeout 150 python3 -c "
import runpy, sys
import mlx_dflash.cuda_attention as c
c.USE_CUDA_ATTENTION = $use
sys.argv = ['launch_costs.py', '--model', '$M', '--draft', '$D']
runpy.run_path('scripts/launch_costs.py', run_name='__main__')" 2>&1 | tee "$OUT/launch_costs_$use.txt" | grep -E "queued|primitives|equal"
  done
fi
ROUNDS=${ROUNDS:-1} bash scripts/device/ab.sh benchmarks/h200-session22/cuda_attention_off.patch \
  --model "$M" --draft "$D" --prompts .device/b/humaneval.jsonl --num-prompts "${NUM_PROMPTS:-16}" --lengths 1024
