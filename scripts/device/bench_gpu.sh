#!/usr/bin/env bash
# Benchmarks on the lent H200 (MLX CUDA): the default pair on HumanEval (8-bit and bf16 draft),
# a random draft as the worst case, mlx-lm's speculative decoding, and scale-mode costs.
# Staging: scripts/device/stage_all.sh (it also writes .device/b/humaneval.jsonl).
# DRAFT: a draft folder (default: the one trained by train_default_draft.sh if this machine
# still has it, else the shipped one). PARTS="default floor policy speculative scale hybrid cycles graphs profile" (any of them, in
# order; default: default); NO_EOS=1 generates the full lengths. speculative needs the two
# Qwen2.5-Coder models staged as pieces .device/q01... (stage_all.sh), kept before this call.
# Results: one $OUT/results-PARTS[-TAG].tgz (TAG names runs made side by side on two GPUs).
set -uo pipefail
source .device/b/env.sh
R=$(mktemp -d)  # packed into one file at the end ($OUT takes at most 8)
export PYTHONPATH=$PWD/src:$PYTHONPATH PYTHONUNBUFFERED=1 MLX_DFLASH_HOME=/tmp/mlxd
# the default pair's target (needs the GGUF staged in .device/c, .device/d), only for the parts
# that use it; DTYPE=float32: the target in float32 (the draft follows it); default bfloat16
if [[ " ${PARTS:-default} " =~ " "(default|floor|policy|cycles|graphs|profile)" " ]]; then
  mkdir -p $MLX_DFLASH_HOME/gguf
  [ -f $MLX_DFLASH_HOME/gguf/smollm2-135m.gguf ] || cp "$DEVICE_FILES/smollm2-135m.gguf" $MLX_DFLASH_HOME/gguf/
  M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype "${DTYPE:-bfloat16}" 2>&1 | tail -1); echo "model: $M"
  D=${DRAFT:-/tmp/work/run-ship/bf16}; [ -d "$D" ] || D=src/mlx_dflash/drafts/smollm2-135m
  echo "draft: $D"
fi
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
for part in ${PARTS:-default}; do case $part in
default)  # the trained draft (train_default_draft.sh on this machine: run-ship/q8 ships, run-ship/bf16) or DRAFT
  Q8=${D%/bf16}/q8; [ -d "$Q8" ] || Q8=$D
  echo "== default pair, 8-bit draft ($Q8) =="
  bench --model "$M" --draft "$Q8" --prompts .device/b/humaneval.jsonl \
    --num-prompts "${NUM_PROMPTS:-8}" --lengths ${LENGTHS:-1024} --out "$R/default_q8"
  if [ "$Q8" != "$D" ]; then
    echo "== default pair, bf16 draft ($D) =="
    bench --model "$M" --draft "$D" --prompts .device/b/humaneval.jsonl \
      --num-prompts "${NUM_PROMPTS:-8}" --lengths 1024 --out "$R/default_bf16"
  fi ;;
floor)  # a useless (random) draft: the adaptive policy's floor
  echo "== default model, a random draft =="
  random_draft "$M/config.json" 16 /tmp/random_draft
  bench --model "$M" --draft /tmp/random_draft --prompts .device/b/humaneval.jsonl \
    --num-prompts 4 --lengths 1024 --out "$R/default_random_draft" ;;
speculative)
  # mlx-lm's speculative decoding (Qwen2.5-Coder-0.5B drafting for the 1.5B, both 4-bit) next to
  # plain decoding and DFlash with a random draft (no trained DFlash draft for this target yet)
  mkdir -p /tmp/models && tar xf "$DEVICE_FILES/qwen-pair-q4.tar" -C /tmp/models
  random_draft /tmp/models/qwen2.5-coder-1.5b/config.json 151935 /tmp/qwen_random_draft
  echo "== Qwen2.5-Coder-1.5B 4-bit: mlx-lm speculative (0.5B draft, 3 tokens) =="
  bench --model /tmp/models/qwen2.5-coder-1.5b --ar-draft /tmp/models/qwen2.5-coder-0.5b --draft /tmp/qwen_random_draft \
    --prompts .device/b/humaneval.jsonl --num-prompts "${NUM_PROMPTS:-4}" --lengths 256 1024 --out "$R/speculative" ;;
scale)  # the draft vocabulary at Qwen3.5-9B's shape (4-bit target, 248k-way head): per-cycle costs
  for vocab in "" 32768; do
    echo "== Qwen3.5-9B shape, 4-bit, per-cycle costs, draft vocabulary: ${vocab:-all} =="
    bench --scale qwen3.5-9b --quant 4 --costs-only --lengths 1024 ${vocab:+--draft-vocab $vocab} --out "$R/q35_9b_vocab${vocab:-all}"
  done ;;
hybrid)  # Qwen3.5-9B shape, bf16, random weights: our CUDA delta-rule kernel against mlx-lm's ops
  # (pytest: stage_all.sh stages its wheels), one Gated DeltaNet layer's verify + rollback
  # (mlx-lm's mixer + replay vs delta_rule.py's two forms), per-cycle costs, then the replay
  # goals (>= 4x at 1,024 tokens, >= 2x at 4,096)
  python3 -m pytest -p no:cacheprovider -o addopts="" -q -rs tests/test_delta_rule.py 2>&1 | tail -4
  python3 scripts/hybrid_rollback_costs.py
  bench --scale qwen3.5-9b --costs-only --lengths 1024 4096 --out "$R/q35_9b_costs"
  bench --scale qwen3.5-9b --lengths ${LENGTHS:-1024 4096} --num-prompts 1 --replay-mean 6.5 --out "$R/q35_9b_replay" ;;
policy)  # the adaptive policy past the answers' end (--no-eos) and within them, with what it timed
  bench --model "$M" --draft "$D" --prompts .device/b/humaneval.jsonl --num-prompts 2 --lengths 512 --no-eos \
    --baselines-first --out "$R/policy_noeos"
  bench --model "$M" --draft "$D" --prompts .device/b/humaneval.jsonl --num-prompts 4 --lengths 1024 \
    --baselines-first --out "$R/policy_eos"
  python3 scripts/policy_report.py "$R/policy_noeos/results.json" "$R/policy_eos/results.json" ;;
cycles)  # each piece of a cycle alone (compiled draft pass beside the eager one), then what a
  # text's first and last cycles cost beyond steady ones, on prompts new to the process
  python3 scripts/launch_costs.py --model "$M" --draft "$D" 2>&1 | tee "$R/launch_costs.txt"
  python3 scripts/first_cycles.py --model "$M" --draft "$D" --prompts .device/b/humaneval.jsonl \
    --num-prompts 8 --tokens 1024 2>&1 | tee "$R/first_cycles.txt" ;;
graphs)  # MLX's CUDA graph cache (400 graphs by default) against a larger one: does mlx-lm still
  # slow down after DFlash in a process, and do DFlash's cycles (many shapes) get cheaper?
  for size in 400 4000; do
    echo "== MLX_CUDA_GRAPH_CACHE_SIZE=$size"
    MLX_CUDA_GRAPH_CACHE_SIZE=$size python3 scripts/baseline_interaction.py --model "$M" --draft "$D" --prompts .device/b/humaneval.jsonl 2>&1 | quiet | tail -8
    MLX_CUDA_GRAPH_CACHE_SIZE=$size bench --model "$M" --draft "$D" --prompts .device/b/humaneval.jsonl \
      --num-prompts 4 --lengths 1024 --out "$R/graph_cache_$size"
  done ;;
profile)  # where a cycle's time goes (draft, verify, a plain step), per block size
  python3 scripts/profile_cycle.py smollm2-135m "$D" --blocks 4 8 16 --prompts .device/b/humaneval.jsonl 2>&1 | quiet ;;
*) echo "unknown part: $part" ;;
esac; done
tar czf "$OUT/results-${PARTS// /-}${DTYPE:+-$DTYPE}${TAG:+-$TAG}.tgz" -C $R . && ls -la "$OUT"
