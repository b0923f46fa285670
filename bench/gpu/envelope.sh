#!/bin/bash
# What a wide admission envelope costs on the GPU against a tight one: start one engine of the evaluation's
# H200 shape (bench/evaluation/profiles/h200.yaml) with --max-num-seqs $1 (or vLLM's default: "default"),
# wait for /health, keep its log, /metrics and the GPU's memory use, stop it. Results in $OUT/envelope-$1/.
#   PYTHONPATH=/tmp/site bash bench/gpu/envelope.sh 8
set -uo pipefail
mns=$1; d=$OUT/envelope-$mns; mkdir -p "$d"
extra=(); [ "$mns" != default ] && extra=(--max-num-seqs "$mns")
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_CACHE_ROOT=/tmp/vllm-cache
t0=$(date +%s.%N)
python3 -m vllm.entrypoints.openai.api_server --model /tmp/parts/model --served-model-name llama-8b-shape \
  --load-format dummy --dtype bfloat16 --max-model-len 4096 --gpu-memory-utilization 0.4 --seed 0 \
  --port 8100 "${extra[@]}" > "$d/server.log" 2>&1 &
pid=$!
for i in $(seq 1 300); do curl -sf localhost:8100/health >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
t1=$(date +%s.%N)
curl -s localhost:8100/metrics > "$d/metrics.prom"
nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader > "$d/gpu-memory.txt"
python3 -c "print(f'healthy after {$t1 - $t0:.1f} s')" | tee "$d/startup.txt"
kill -TERM $pid; for i in $(seq 1 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill -9 $pid 2>/dev/null
grep -E "KV cache size|Maximum concurrency|Graph capturing|torch.compile|Model loading took|Available KV|init engine|memory" "$d/server.log" | cut -c1-220 | tail -20
cat "$d/gpu-memory.txt"
