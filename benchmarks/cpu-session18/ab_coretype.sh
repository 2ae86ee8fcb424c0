#!/usr/bin/env bash
# bench x4 256 with OpenBLAS's Prescott kernels (what it detects on this VM) and SkylakeX's, alternating
cd "$(dirname "$0")/../.."
for round in 1 2; do
  for core in Prescott SkylakeX; do
    echo "== round $round, OPENBLAS_CORETYPE=$core"
    OPENBLAS_CORETYPE=$core MLX_DFLASH_HOME=$HOME/.cache/mlx-dflash PYTHONPATH=src /tmp/venv/bin/python -m mlx_dflash.cli \
      bench --num-prompts 4 --lengths 256 --out benchmarks/cpu-session18/ab_coretype/$core-$round 2>&1 | tr '\r' '\n' | grep -E '^\|'
  done
done
