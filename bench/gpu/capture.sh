#!/bin/bash
# Record a queue-bound bad start on the GPU machine, for tests/fixtures/vllm/h200-queue-bound/: one engine of
# the evaluation's H200 shape (bench/evaluation/profiles/h200.yaml) started with --max-num-seqs 8, vLLM's own
# benchmark client with 64 concurrent clients (512 prompt / 256 output tokens, 384 requests), /metrics every
# 5 s. Everything lands in $OUT/capture/ (NNN.prom, scraped_at, bench.json, server.log, models.json).
#   PYTHONPATH=/tmp/site bash bench/gpu/capture.sh
set -uo pipefail
d=$OUT/capture; mkdir -p "$d"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_CACHE_ROOT=/tmp/vllm-cache
args=(--model /tmp/parts/model --served-model-name llama-8b-shape --load-format dummy --dtype bfloat16
      --max-model-len 4096 --gpu-memory-utilization 0.4 --seed 0 --host 127.0.0.1 --port 8100 --max-num-seqs 8)
printf '%s\n' "${args[@]}" > "$d/engine_args.txt"
python3 -m vllm.entrypoints.openai.api_server "${args[@]}" > "$d/server.log" 2>&1 &
pid=$!
for i in $(seq 1 300); do curl -sf localhost:8100/health >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
curl -s localhost:8100/v1/models > "$d/models.json"; curl -s localhost:8100/version > "$d/version.json"
python3 - > "$d/bench.txt" 2>&1 <<'PY' &
import argparse, os
from vllm.benchmarks import serve
p = argparse.ArgumentParser(); serve.add_cli_args(p)
a = p.parse_args(("--backend vllm --base-url http://127.0.0.1:8100 --model llama-8b-shape --tokenizer /tmp/parts/model "
                  "--dataset-name random --random-input-len 512 --random-output-len 256 --num-prompts 384 "
                  "--request-rate inf --max-concurrency 64 --ignore-eos --seed 0 --percentile-metrics ttft,tpot,itl,e2el "
                  "--save-result --result-dir " + os.environ["OUT"] + "/capture --result-filename bench.json").split())
serve.main(a)
PY
bp=$!
k=0
while kill -0 $bp 2>/dev/null && [ $k -lt 40 ]; do
  curl -s localhost:8100/metrics > "$d/$(printf %03d $k).prom"; date +%s.%N >> "$d/scraped_at"; k=$((k+1)); sleep 5
done
wait $bp
curl -s localhost:8100/metrics > "$d/$(printf %03d $k).prom"; date +%s.%N >> "$d/scraped_at"
kill -TERM $pid; for i in $(seq 1 60); do kill -0 $pid 2>/dev/null || break; sleep 1; done; kill -9 $pid 2>/dev/null
grep -A22 "Serving Benchmark" "$d/bench.txt" | head -24; ls "$d" | wc -l
