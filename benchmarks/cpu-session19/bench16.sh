#!/usr/bin/env bash
# The CPU bench on 16 HumanEval prompts instead of 4 (the 4-prompt runs' per-prompt ratios span
# 0.96x-2.1x), 16-token blocks (the default) and 8-token blocks, in one script.
set -uo pipefail
export MLX_DFLASH_HOME=${MLX_DFLASH_HOME:-$HOME/.cache/mlx-dflash}
D=benchmarks/cpu-session19
for block in 16 8; do
  mlx-dflash bench --num-prompts 16 --lengths 256 --block-size $block --out $D/bench16_block$block 2>&1 \
    | tr '\r' '\n' | grep -v "run/s\]$" | tail -8
done
