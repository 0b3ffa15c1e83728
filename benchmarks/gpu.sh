#!/usr/bin/env bash
# The GPU checks and benchmarks in one go, for a machine with a CUDA GPU. Each part has its own
# time limit (200 + 220 + 100 s, each killed 10 s after its limit if it ignores SIGTERM), so with
# imports and the wheel install the whole takes at most about 9 min 30 s: it fits a 10-minute slot.
#
#   bash benchmarks/gpu.sh OUT_DIR
#
# writes into OUT_DIR: env.txt (GPU, driver, torch), gpu_tests.log (pytest -m gpu: every precision
# mode on CUDA, DDP/FSDP over nccl, host syncs per step), compare_loops.md/.json (halfprec vs a
# raw loop vs Lightning vs Accelerate, per precision mode, images/s, MFU, peak memory), memory.md/.json
# (peak memory per precision mode against the analytic estimate).
# On a machine without a GPU it says so, writes SKIPPED.md and exits 0.
#
# An offline GPU machine whose Python lacks this project's pure-Python dependencies (hydra-core,
# omegaconf, antlr4; torchao for precision=fp8) can take them as wheels in .whl/ at the repo root; they are installed into
# a temp dir first. Make them here with: bash benchmarks/gpu.sh --wheels
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ "${1:-}" = "--wheels" ]; then
    # pure-Python wheels for the dependencies a bare CUDA image tends to lack (antlr4 ships no wheel: built here)
    mkdir -p .whl
    "$PY" -m pip wheel --no-deps -q -w .whl "hydra-core>=1.3.2,<1.4" "omegaconf>=2.3,<2.4" "antlr4-python3-runtime==4.9.3" torchao
    ls .whl
    exit 0
fi
out=${1:?usage: bash benchmarks/gpu.sh OUT_DIR   (or --wheels)}
mkdir -p "$out"

if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/halfprec-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/halfprec-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu.sh: no CUDA GPU visible here: GPU tests and benchmarks skipped" | tee "$out/SKIPPED.md"
    exit 0
fi
if ! "$PY" -c "import hydra, omegaconf" 2> /dev/null; then
    echo "gpu.sh: hydra-core/omegaconf missing and no .whl/ wheels: run 'bash benchmarks/gpu.sh --wheels' where pip works" >&2
    exit 1
fi

{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2> /dev/null
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

status=0
# 1. the GPU-marked tests (~3 min)
timeout -k 10 200 "$PY" -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider 2>&1 | tee "$out/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# 2. the loop comparison on the GPU (~3-4 min; its tables are rewritten after every row, so a run
# cut short keeps what it measured)
timeout -k 10 220 "$PY" benchmarks/compare_loops.py --device cuda --json "$out/compare_loops.json" \
    --markdown "$out/compare_loops.md" 2>&1 | tail -n 60
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

# 3. peak memory per precision mode against the estimate (~1-2 min)
timeout -k 10 100 "$PY" benchmarks/memory.py --device cuda --json "$out/memory.json" --markdown "$out/memory.md" 2>&1 |
    tail -n 30
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "gpu.sh: results in $out (exit $status)"
exit $status
