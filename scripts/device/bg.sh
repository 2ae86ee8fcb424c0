#!/usr/bin/env bash
# A job on the lent GPU machine that outlives the device call starting it: training keeps
# running while later calls stage files or run benchmarks (the machine stays while calls keep
# coming). The job runs from a snapshot of src/, scripts/ and .device/{b,data} (later calls
# replace the tree) and writes its $OUT files to /tmp/bg/NAME/out.
#   bash scripts/device/bg.sh start NAME COMMAND...   returns at once; log: /tmp/bg/NAME.log
#   bash scripts/device/bg.sh wait NAME [SECONDS]     waits for it to end (at most SECONDS), prints
#                                                     the log's tail, copies its files to this call's $OUT
set -uo pipefail
action=$1 name=$2; shift 2
dir=/tmp/bg/$name
case $action in
start)
  rm -rf "$dir"; mkdir -p "$dir/out" "$dir/.device"
  cp -r src scripts "$dir/"; cp -r .device/b "$dir/.device/"; [ -d .device/data ] && cp -r .device/data "$dir/.device/"
  (cd "$dir" && OUT=$dir/out setsid nohup bash -c "$*; echo \$? > $dir/exit_code" > /tmp/bg/$name.log 2>&1 < /dev/null &)
  echo "started $name in $dir" ;;
wait)
  deadline=$((SECONDS + ${1:-580}))
  while [ ! -f "$dir/exit_code" ] && [ $SECONDS -lt $deadline ]; do sleep 5; done
  tr '\r' '\n' < /tmp/bg/$name.log | grep -Ev 'step/s|prompt/s|run/s' | tail -25
  if [ -f "$dir/exit_code" ]; then
    echo "$name exited with $(cat $dir/exit_code)"; cp "$dir"/out/* /tmp/bg/$name.log "$OUT"/ 2>/dev/null
  else
    echo "$name still running"
  fi ;;
esac
