#!/usr/bin/env bash
# One accelerator session in one command (the device tool's `run`, from the repository root):
# what the GPU is, scripts/bench_gpu.py, then a smoke test (jinfer's float32 logits against
# transformers for every model family, computed on the GPU at JAX's default matmul precision, and
# the Pallas paged decode-attention kernel against the einsum attention in bfloat16).
# Logs and results go to $OUT (the device tool's folder that comes back) or results/. Uses the
# machine's own python3 and packages; nothing is installed.
set -uo pipefail
out=${OUT:-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import jax, torch, transformers as t; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', t.__version__)"
timeout "${BENCH_TIMEOUT:-150}" python3 scripts/bench_gpu.py --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_gpu.log"
timeout "${SMOKE_TIMEOUT:-90}" python3 -m pytest -q -p no:cacheprovider tests/test_parity.py tests/test_kv_cache.py \
    -k "full_sequence or paged_decode_attention" 2>&1 | tee "$out/smoke.log" | tail -4
