#!/usr/bin/env bash
# blas_ab.sh with 8-token blocks (fixed, and the adaptive policy's largest size): BLIS's 16-row
# products fall off its no-packing path, so its 16-token blocks are slow (blas_libraries.txt).
set -uo pipefail
export MLX_DFLASH_HOME=${MLX_DFLASH_HOME:-$HOME/.cache/mlx-dflash}
D=benchmarks/cpu-session19
for blas in openblas blis; do
  if [ $blas = blis ]; then
    export LD_PRELOAD=/usr/lib/x86_64-linux-gnu/blis-pthread/libblas.so.3 BLIS_NUM_THREADS=2
  else
    unset LD_PRELOAD BLIS_NUM_THREADS
  fi
  echo "== $blas, 8-token blocks"
  mlx-dflash bench --num-prompts 8 --lengths 256 --block-size 8 --out $D/blas_ab_block8/$blas 2>&1 \
    | tr '\r' '\n' | grep -v "run/s\]$" | tail -5
done
