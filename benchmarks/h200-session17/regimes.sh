source .device/b/env.sh >/dev/null 2>&1
export PYTHONPATH=$PWD/src:$PYTHONPATH MLX_DFLASH_HOME=/tmp/mlxd PYTHONUNBUFFERED=1
mkdir -p /tmp/mlxd/gguf; cp $DEVICE_FILES/smollm2-135m.gguf /tmp/mlxd/gguf/
M=$(python3 -m mlx_dflash.cli models fetch smollm2-135m --dtype bfloat16 2>/dev/null | tail -1)
nvidia-smi topo -m 2>&1 | head -4; nproc; ls /sys/devices/system/node | grep node
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,pstate --format=csv
T0=$SECONDS
one() {  # PIN: a fresh process: bench x2 512, the CPUs it ran on
  $1 python3 -m mlx_dflash.cli bench --model $M --draft src/mlx_dflash/drafts/smollm2-135m \
    --prompts .device/b/humaneval.jsonl --num-prompts 2 --lengths 512 --baselines-first > /tmp/b.txt 2>&1 & pid=$!
  cpus=""; while kill -0 $pid 2>/dev/null; do cpus="$cpus $(ps -o psr= -L -p $pid 2>/dev/null | sort -n | uniq -c | sort -rn | head -1 | awk '{print $2}')"; sleep 1; done
  grep -E '^\| (baseline|dflash)' /tmp/b.txt | cut -d'|' -f2-5 | tr '\n' ' '; echo " | main cpu each second:$cpus"
}
for i in 1 2 3 4; do echo "== free $i"; one ""; done
echo "free: $((SECONDS-T0)) s"
for i in 1 2 3 4; do echo "== pinned to cpus 0-3, $i"; one "taskset -c 0-3"; done
echo "all: $((SECONDS-T0)) s"
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,power.draw,pstate --format=csv
