#!/usr/bin/env bash
# Issue 79's GPU checks, prepared on the CPU for one run on a lent device (an H100 or H200 with
# the image's CUDA torch; about 7 minutes there): the package built there, the static forward's
# tests (its torch.compile(fullgraph=True) included), and t(n) eager / static / captured (CUDA
# graphs through torch.compile's reduce-overhead mode) at SmolLM2-135M's shapes in float32 (the
# one-token bar: <= 3 ms captured) and at Llama-3-8B's in bf16 (the projection). Results land in
# $OUT (the device tool's folder) or bench/results.
#
#   device run, timeout_s 540:  bash bench/device_check.sh
#   here, the same steps on the CPU at small sizes (a check of the script, about 2 minutes):
#                               DEVICE=cpu bash bench/device_check.sh
#
# Weights: none travel. Timing a forward needs no trained weights (random ones of the same shapes
# cost the same), and SmolLM2's GGUF (98 MB) is larger than what a call may carry (64 MiB). The
# checks that need the trained model (bench/real_model.py --device cuda --prompts 4 with the plain
# column, bench/batch_bench.py at B = 1, 8, 16) run at the end only where $LOOKUPDEC_MODEL names a
# model file already on the machine.
set -euo pipefail
device=${DEVICE:-cuda}
out=${OUT:-bench/results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=python3
if [ "$device" = cuda ]; then
  if ls .whl/*.whl >/dev/null 2>&1; then  # wheels the image lacks, carried (see the device README)
    $py -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  fi
  $py -m pip install -q --no-index --no-deps --no-build-isolation -e . 2>&1 | tail -3
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/device_check_gpu.txt"
  small=smollm2-135m big=llama3-8b sizes="1 2 4 8 16 32 64 128" repeats=20
else
  small=small big=small sizes="1 4 16" repeats=3
fi
$py -m pytest -q -x -p no:cacheprovider tests/model/test_static.py tests/system/test_gpu_projection.py \
  2>&1 | tee "$out/device_check_tests.log" | tail -3
# (the replay's workloads: code edits alone keep the run short; its MAT does not change t(n))
timeout 200 $py bench/gpu_projection.py --config $small --device "$device" --dtype float32 --sizes $sizes \
  --repeats $repeats --workloads code-edit --limit 4 --out "$out/gpu_projection_${small}_$device.json"
timeout 240 $py bench/gpu_projection.py --config $big --device "$device" --sizes $sizes --repeats $repeats \
  --out "$out/gpu_projection_${big}_$device.json"
if [ -n "${LOOKUPDEC_MODEL:-}" ] && [ "$device" = cuda ]; then
  timeout 300 $py bench/real_model.py --device cuda --model "$LOOKUPDEC_MODEL" --threads 1 --prompts 4 \
    --out "$out/real_model_$device.json"
  timeout 240 $py bench/batch_bench.py --device cuda --model "$LOOKUPDEC_MODEL" --threads 1 \
    --workloads log_to_json code_edit --batch-sizes 1 8 16 --out "$out/batch_$device.json"
fi
echo "device_check: done ($device)"
