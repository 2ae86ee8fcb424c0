#!/usr/bin/env bash
# Second device call: the kernel's end-to-end tests on the GPU, where a cycle's host time goes
# with the kernel (scripts/cycle_timeline.py), then compiled draft passes (compiled_passes.patch:
# draft.COMPILE_PASSES = None, compiled on GPUs) against the committed eager ones, x16 float32.
set -uo pipefail
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
timeout 150 python3 -m pytest -p no:cacheprovider -o addopts="" -q -rs tests/test_cuda_attention.py -k "greedy or takes or rebinds" 2>&1 | tail -4 | tee "$OUT/tests_e2e.txt"
mkdir -p $MLX_DFLASH_HOME/gguf
[ -f $MLX_DFLASH_HOME/gguf/smollm2-135m.gguf ] || cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype float32 2>&1 | tail -1); echo "model: $M"
D=src/mlx_dflash/drafts/smollm2-135m
timeout 120 python3 scripts/cycle_timeline.py --model "$M" --draft "$D" --prompts .device/b/humaneval.jsonl \
  --prompt-index 3 12 --tokens 512 2>&1 | tee "$OUT/cycle_timeline.txt" | tail -30
ROUNDS=${ROUNDS:-1} bash scripts/device/ab.sh benchmarks/h200-session22/compiled_passes.patch \
  --model "$M" --draft "$D" --prompts .device/b/humaneval.jsonl --num-prompts "${NUM_PROMPTS:-16}" --lengths 1024
