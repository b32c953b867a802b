#!/usr/bin/env bash
# The checks that need a GPU, in one run on a lent machine (the device tool), results in $OUT:
#   1. the CUDA paths' tests (tests/test_cuda_paths.py and the CUDA cases of other files);
#   2. benchmarks/gpu.py: GPT-2 small, bf16 and fp16, eager then torch.compile;
#      "control": compile, bf16, with a second plain run (is plain itself bitwise reproducible?);
#   3. benchmarks/gpu_memory.py: the extra peak memory by configuration.
# Each stage has its own time limit, so one that hangs leaves the others' results.
# Usage (on the GPU machine, repository root): OUT=/some/dir bash tools/gpu_checks.sh [stages]
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD/src:${PYTHONPATH:-} PYTHONUNBUFFERED=1
STAGES=${1:-tests,eager,compile,memory}
python3 - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch, platform, os
print("torch", torch.__version__, "cuda", torch.version.cuda, "python", platform.python_version())
print("device", torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, "load", os.getloadavg())
PY
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.max.sm,temperature.gpu --format=csv 2>&1 | tee -a "$OUT/env.txt"
if [[ $STAGES == *tests* ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider -rs --timeout=200 -o addopts="" \
    tests/test_cuda_paths.py tests/test_dynamics_readback.py::test_every_monitor_on_cuda \
    tests/test_integration_lightning.py::test_fp16_mixed_on_gpu_goes_through_the_gradscaler \
    2>&1 | tee "$OUT/tests.log" | tail -40
fi
if [[ $STAGES == *eager* ]]; then
  timeout 200 python3 benchmarks/gpu.py --modes eager --json "$OUT/gpu_eager.json" 2>&1 | grep -v Warning | tee "$OUT/gpu_eager.log" | tail -14
fi
if [[ $STAGES == *compile* ]]; then
  timeout 300 python3 benchmarks/gpu.py --modes compile --json "$OUT/gpu_compile.json" 2>&1 | grep -v Warning | tee "$OUT/gpu_compile.log" | tail -14
fi
if [[ $STAGES == *control* ]]; then
  timeout 240 python3 benchmarks/gpu.py --modes compile --precisions bf16 --tools plain,plain_again,nantrace,nantrace_syncfree \
    --json "$OUT/gpu_control.json" 2>&1 | grep -v Warning | tee "$OUT/gpu_control.log" | tail -8
fi
if [[ $STAGES == *memory* ]]; then
  timeout 200 python3 benchmarks/gpu_memory.py 2>&1 | tee "$OUT/gpu_memory.log" | tail -12
fi
