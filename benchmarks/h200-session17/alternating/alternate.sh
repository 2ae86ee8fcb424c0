source .device/b/env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD/src:$PYTHONPATH MLX_DFLASH_HOME=/tmp/mlxd PYTHONUNBUFFERED=1
mkdir -p /tmp/mlxd/gguf; cp $DEVICE_FILES/smollm2-135m.gguf /tmp/mlxd/gguf/
M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype bfloat16 2>/dev/null | tail -1)
T0=$SECONDS
for i in 1 2 3; do
  echo "== process $i, alternating per prompt, x4 1024, 2 repeats"
  timeout 100 python3 -m mlx_dflash.cli bench --model $M --draft src/mlx_dflash/drafts/smollm2-135m \
    --prompts .device/b/humaneval.jsonl --num-prompts 4 --lengths 1024 --repeats 2 --out $OUT/alt$i 2>&1 | grep -E '^\| (baseline|dflash)'
  rm -f $OUT/alt$i/*.png
  echo "t=$((SECONDS-T0)) s"
done
