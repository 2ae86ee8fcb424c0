#!/usr/bin/env bash
# OpenBLAS (Debian 0.3.21, SkylakeX kernels) against BLIS (Debian libblis4-pthread 0.9.0, 2
# threads) for the whole process (mlx-lm's baseline and DFlash alike), alternating.
set -uo pipefail
export MLX_DFLASH_HOME=${MLX_DFLASH_HOME:-$HOME/.cache/mlx-dflash}
D=benchmarks/cpu-session19
for round in 1 2; do
  for blas in openblas blis; do
    if [ $blas = blis ]; then
      export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 BLIS_NUM_THREADS=2
    else
      unset LD_PRELOAD BLIS_NUM_THREADS  # mlx-dflash switches to OpenBLAS and its kernels itself
    fi
    echo "== $blas, round $round"
    mlx-dflash bench --num-prompts 8 --lengths 256 --out $D/blas_ab/$blas-$round 2>&1 \
      | tr '\r' '\n' | grep -v "run/s\]$" | tail -5
  done
done
