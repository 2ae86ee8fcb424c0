#!/usr/bin/env bash
# Benchmarks on the lent H200 (MLX CUDA): the default pair on HumanEval (8-bit and bf16
# draft, and a random draft as the worst case), and scale mode (Qwen3.5-9B replay, a 4-bit target with bf16/8-bit drafts).
# Staging: scripts/device/stage_all.sh (it also writes .device/b/humaneval.jsonl).
# DRAFT: a draft folder (default: the one trained by train_default_draft.sh if this machine
# still has it, else the shipped one). PART=default|scale|speculative picks a part; NO_EOS=1
# generates the full lengths. PART=speculative needs the two Qwen2.5-Coder models staged as
# pieces .device/q01... (stage_all.sh), kept on the machine before the .device/b call.
set -uo pipefail
source .device/b/env.sh
R=/tmp/results; rm -rf $R; mkdir -p $R  # packed into one file at the end ($OUT takes at most 8)
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
mkdir -p $MLX_DFLASH_HOME/gguf
[ -f $MLX_DFLASH_HOME/gguf/smollm2-135m.gguf ] || cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype bfloat16 2>&1 | tail -1
D=${DRAFT:-/tmp/work/ship/bf16}; [ -d "$D" ] || D=src/mlx_dflash/drafts/smollm2-135m
echo "draft: $D"
nvidia-smi --query-gpu=name --format=csv,noheader; python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())"
quiet() { tr '\r' '\n' | grep -v 'run/s\]$'; }
EOS_ARGS=(); [ -n "${NO_EOS:-}" ] && EOS_ARGS=(--no-eos)
random_draft() {  # CONFIG_JSON MASK_ID OUT: a random 5-layer draft for that target (a useless draft)
  python3 -c "
import json, sys; from mlx_dflash.draft import create_random_draft, save_draft
save_draft(create_random_draft(json.load(open(sys.argv[1])), num_layers=5, block_size=16,
                               mask_token_id=int(sys.argv[2])), sys.argv[3])" "$@"
}
bench() { python3 -m mlx_dflash.cli bench "${EOS_ARGS[@]}" "$@" 2>&1 | quiet | grep -E '^\||^\{|error' ; }
if [ "${PART:-default}" = default ]; then
  # trained by train_default_draft.sh on this machine: ship/q8 (what ships) and ship/bf16
  Q8=${D%/bf16}/q8; [ -d "$Q8" ] || Q8=$D
  echo "== default pair, 8-bit draft ($Q8) =="
  bench --model smollm2-135m --draft "$Q8" --prompts .device/b/humaneval.jsonl \
    --num-prompts "${NUM_PROMPTS:-8}" --lengths ${LENGTHS:-1024 2048} --out "$R/default_q8"
  echo "== default pair, bf16 draft ($D) =="
  bench --model smollm2-135m --draft "$D" --prompts .device/b/humaneval.jsonl \
    --num-prompts "${NUM_PROMPTS:-8}" --lengths 1024 --out "$R/default_bf16"
  echo "== default model, a useless (random) draft: the adaptive policy's floor =="
  random_draft "$(ls $MLX_DFLASH_HOME/models/smollm2-135m*/config.json | head -1)" 16 /tmp/random_draft
  bench --model smollm2-135m --draft /tmp/random_draft --prompts .device/b/humaneval.jsonl \
    --num-prompts 4 --lengths 1024 --out "$R/default_random_draft"
elif [ "${PART}" = speculative ]; then
  # mlx-lm's speculative decoding (Qwen2.5-Coder-0.5B drafting for the 1.5B, both 4-bit) next to
  # plain decoding and DFlash with a random draft (no trained DFlash draft for this target yet)
  mkdir -p /tmp/models && tar xf "$DEVICE_FILES/qwen-pair-q4.tar" -C /tmp/models
  random_draft /tmp/models/qwen2.5-coder-1.5b/config.json 151935 /tmp/qwen_random_draft
  echo "== Qwen2.5-Coder-1.5B 4-bit: mlx-lm speculative (0.5B draft, 3 tokens) =="
  bench --model /tmp/models/qwen2.5-coder-1.5b --ar-draft /tmp/models/qwen2.5-coder-0.5b --draft /tmp/qwen_random_draft \
    --prompts .device/b/humaneval.jsonl --num-prompts "${NUM_PROMPTS:-4}" --lengths ${LENGTHS:-256 1024} --out "$R/speculative"
else
  # a full replay generation at this shape did not finish in 540 s (per-token recurrence on CUDA)
  echo "== Qwen3.5-9B shape, bf16, per-cycle costs =="
  bench --scale qwen3.5-9b --costs-only --lengths 1024 4096 --out "$R/q35_9b"
  echo "== Qwen3-8B shape, 4-bit target: bf16 draft, then 8-bit draft =="
  bench --scale qwen3-8b --quant 4 --lengths 1024 --num-prompts 1 --replay-mean 6.5 --out "$R/q3_8b_q4"
  bench --scale qwen3-8b --quant 4 --draft-quant 8 --lengths 1024 --num-prompts 1 --replay-mean 6.5 \
    --out "$R/q3_8b_q4_d8"
fi
tar czf "$OUT/results-${PART:-default}.tgz" -C $R . && ls -la "$OUT"
