#!/bin/bash
# On the GPU machine, after bench/gpu/setup.sh: run evaluation arms in the background and wait on them across
# calls (the machine goes back 30 s after a call ends, a call lasts at most 10 minutes, and a later call lays
# the working tree anew: the run works from its own copy in /tmp/repo).
#   bench/gpu/evaluate.sh start PROFILE "ARGS1" ["ARGS2" ...]   one `python3 -m bench.evaluate` per ARGS, in turn
#   bench/gpu/evaluate.sh start --each "PROFILE1 ARGS1" ["PROFILE2 ARGS2" ...]   one per profile, each into
#                                                      /tmp/eval/<profile name> (several traces in one lease)
#   bench/gpu/evaluate.sh wait [SECONDS]                        print the log as it grows until done or SECONDS
#   bench/gpu/evaluate.sh pack                                  the raw data as $OUT/eval.tgz
set -u
cmd=${1:?start|wait|pack}; shift
log=/tmp/eval.log
case $cmd in
start)
  profile=$1; shift
  rm -rf /tmp/repo && mkdir -p /tmp/repo && cp -r . /tmp/repo/ && rm -rf /tmp/repo/.gpu
  {
    echo "cd /tmp/repo && export PYTHONPATH=/tmp/site:/tmp/repo VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1"
    for a in "$@"; do
      if [ "$profile" = --each ]; then
        set -- $a; p=$1; shift
        echo "python3 -m bench.evaluate --profile $p --out /tmp/eval/$(basename "$p" .yaml) --no-plots --no-report $*"
      else
        echo "python3 -m bench.evaluate --profile $profile --out /tmp/eval --no-plots --no-report $a"
      fi
    done
    echo "echo EVAL-DONE"
  } > /tmp/eval.sh
  setsid nohup bash /tmp/eval.sh > "$log" 2>&1 < /dev/null &
  echo "started $(cat /tmp/eval.sh | wc -l) lines, pid $!"
  ;;
wait)
  limit=${1:-560}; seen=0; t0=$(date +%s)
  while :; do
    n=$(wc -l < "$log"); if [ "$n" -gt "$seen" ]; then sed -n "$((seen + 1)),${n}p" "$log" | cut -c1-400; seen=$n; fi
    grep -q EVAL-DONE "$log" && break
    [ $(( $(date +%s) - t0 )) -ge "$limit" ] && { echo "still running after ${limit}s"; break; }
    sleep 5
  done
  nvidia-smi --query-gpu=memory.used,utilization.gpu,temperature.gpu --format=csv,noheader
  ;;
pack)
  cp "$log" /tmp/eval/ 2>/dev/null
  tar czf "$OUT/eval.tgz" -C /tmp eval && ls -l "$OUT/eval.tgz"
  ;;
esac
