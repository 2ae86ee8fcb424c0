#!/usr/bin/env bash
# Last device call: block attention through cuda_attention against MLX's own call by key length
# (scripts/attention_kernel_costs.py); packed draft passes (as committed) against plain ones (packed_passes_off.patch),
# the default pair x16 HumanEval 1,024 tokens float32, one round each (scripts/device/ab.sh); then
# the replay at Qwen3.5-9B's shape (bf16 random weights, mean acceptance 6.5, head size 256 in its
# attention layers, through cuda_attention) at 1,024 tokens where REPLAY_S (seconds) is set.
set -uo pipefail
source .device/b/env.sh
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
mkdir -p $MLX_DFLASH_HOME/gguf
[ -f $MLX_DFLASH_HOME/gguf/smollm2-135m.gguf ] || cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype float32 2>&1 | tail -1); echo "model: $M"
timeout 90 python3 scripts/attention_kernel_costs.py 2>&1 | tee "$OUT/attention_kernel_costs.txt"
ROUNDS=1 timeout 300 bash scripts/device/ab.sh benchmarks/h200-session22/packed_passes_off.patch \
  --model "$M" --draft src/mlx_dflash/drafts/smollm2-135m --prompts .device/b/humaneval.jsonl --num-prompts 16 --lengths 1024
if [ -n "${REPLAY_S:-}" ]; then  # (this session's device time ran short: not run)
  echo "== Qwen3.5-9B shape, replay 6.5"
  R=$(mktemp -d)
  timeout "$REPLAY_S" python3 -m mlx_dflash.cli bench --scale qwen3.5-9b --lengths 1024 --num-prompts 1 \
    --replay-mean 6.5 --out "$R/q35_9b_replay" 2>&1 | tr '\r' '\n' | grep -E '^\||rror'
  tar czf "$OUT/replay.tgz" -C "$R" .
fi
