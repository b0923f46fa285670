#!/bin/bash
# On the GPU machine (no internet): unpack what was carried under .gpu/ (made here by bench/gpu/bundle.sh) into
# /tmp, the only place that survives between two calls while the machine stays warm:
#   /tmp/site   vLLM 0.26 and the wheels it and the tuner lack (PYTHONPATH=/tmp/site)
#   /tmp/parts  the model directory (an 8B-shaped Llama config + tokenizer; weights come from --load-format dummy)
#   /tmp/nginx  nginx from Debian's package (dpkg -x)
# Idempotent: call it in every command; it copies what this call carried and unpacks once everything is there.
set -euo pipefail
mkdir -p /tmp/parts /tmp/site /tmp/nginx
for d in .gpu/a .gpu/b .gpu/c .gpu/d; do
  if [ -d "$d" ]; then cp -r "$d"/. /tmp/parts/; fi
done
if [ ! -f /tmp/site/vllm/__init__.py ] && [ -f /tmp/parts/vllm026.part.ac ] && [ -d /tmp/parts/whl ]; then
  cat /tmp/parts/vllm026.part.a? | tar -C /tmp/site -xJf -
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    /tmp/parts/whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
  for deb in /tmp/parts/debs/*.deb; do dpkg -x "$deb" /tmp/nginx; done
fi
export PYTHONPATH=/tmp/site
python3 -c "import vllm, torch, tuner.cli, vllm_tuner_plugin, apscheduler, httpx; print('vllm', vllm.__version__, 'torch', torch.__version__, torch.cuda.get_device_name(0))"
/tmp/nginx/usr/sbin/nginx -v
