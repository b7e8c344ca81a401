#!/usr/bin/env bash
# The GPU checks of issues 53 and 55, as one prepared call on the GPU host (after benchmarks/gpu_carry.py's
# parts are stashed there): bash benchmarks/gpu_checks.sh PHASE... ; each phase under its own time limit,
# its log and results in $OUT (what the device tool brings back). Phases, in the order issue 55 asks:
#   tests    tests/test_gpu.py, every test, -rP so the bf16 near-tie counts print (~5 min, compiles)
#   quick    tests/test_gpu.py without the real-model lossless tests (~1 min)
#   ort      benchmarks/ort_gpu.py: ORT's CUDA EP on the default model, float32 and float16 (~2 min)
#   feature  specpass bench: the feature draft's rows beside Hydra + combined, float32 (~3 min)
#   batch    benchmarks/batch.py: inductor, B = 32 8 1, bf16, HF static + compile in the same run (~5 min)
#   step     benchmarks/gpu_step.py: the one-token step and the 8B-shaped decode against its floor (~3 min)
#   feature-train  the feature draft's GPU recipe (train-heads --kind feature --device cuda), a call of its own;
#            the draft comes back in 15 MiB parts (here: cat feature_draft.part-* > feature_draft.safetensors)
set -uo pipefail
OUT=${OUT:-out}
mkdir -p "$OUT"
python3 benchmarks/gpu_carry.py install || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
python3 -m pip install -q --no-deps --no-build-isolation -e . || exit 1  # the torch.compile backend's entry point
python3 -c "import torch, transformers, onnxruntime as ort; print(torch.__version__, transformers.__version__, ort.__version__, ort.get_available_providers(), torch.cuda.get_device_name())" | tee "$OUT/versions.txt"

phase() {  # phase NAME SECONDS COMMAND...: run it under a limit, its output to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | tail -n 25
  echo "== $name: exit ${PIPESTATUS[0]}"
}

for name in "$@"; do
  case $name in
    tests) phase tests 420 python3 -m pytest -q -rP -n 4 -p no:cacheprovider tests/test_gpu.py ;;
    quick) phase quick 150 python3 -m pytest -q -rP -n 4 -p no:cacheprovider tests/test_gpu.py -k "not lossless_on_gpu" ;;
    ort) phase ort 240 python3 benchmarks/ort_gpu.py --prompts 3 --out "$OUT" ;;
    feature) phase feature 300 python3 -m specpass.cli bench --prompts 6 --no-compile-baseline --out "$OUT" --tag feature-gpu \
      --rows specpass_combined specpass_hydra_combined specpass_feature specpass_feature_combined ;;
    batch) phase batch 330 python3 benchmarks/batch.py --device cuda --dtype bfloat16 --prompts 16 --batches 32 8 1 \
      --max-batches 1 --no-alone-reference --lowering inductor --out-dir "$OUT" ;;
    step) phase step 240 python3 benchmarks/gpu_step.py --shapes 135m 8b --dtypes bfloat16 --lowerings inductor --out "$OUT" ;;
    feature-train) phase feature-train 540 python3 -m specpass.cli train-heads --kind feature --prompts 100000 --epochs 8 --sequences 32 \
      --device cuda --out /tmp/feature --corpus /tmp/feature-corpus.pt  # a second call trains from the cached corpus
      cp /tmp/feature/*.json "$OUT/" && split -b 15M /tmp/feature/feature_draft.safetensors "$OUT/feature_draft.part-" ;;  # 16 MiB a file comes back
    *) echo "unknown phase $name" >&2; exit 2 ;;
  esac
done
