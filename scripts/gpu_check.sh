#!/usr/bin/env bash
# One accelerator session in one command (the device tool's `run`, from the repository root):
# what the GPU is, a smoke test (jinfer's logits and greedy tokens against transformers, computed
# on the GPU), then scripts/bench_gpu.py. Logs and results go to $OUT (the device tool's folder
# that comes back) or results/. Uses the machine's own python3 and packages; nothing is installed.
set -uo pipefail
out=${OUT:-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD" HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
python3 -c "import jax, jaxlib, torch, transformers as t; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__, 'transformers', t.__version__)"

# float32 on a GPU: XLA may use TF32 for matmuls unless asked for full precision. Run the logit
# parity once at the default precision (to see whether it holds) and once at "highest".
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/test_parity.py -k full_sequence 2>&1 \
    | tee "$out/smoke_default_precision.log" | tail -5
JAX_DEFAULT_MATMUL_PRECISION=highest timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_parity.py \
    -k "full_sequence or (score_and_greedy and (llama_gqa or mistral or qwen3))" 2>&1 | tee "$out/smoke.log" | tail -8

timeout "${BENCH_TIMEOUT:-300}" python3 scripts/bench_gpu.py --out "$out" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench_gpu.log"
