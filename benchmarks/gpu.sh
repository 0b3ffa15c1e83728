#!/usr/bin/env bash
# The GPU checks and benchmarks in one go, for a machine with a CUDA GPU, within one time budget
# (GPU_SH_BUDGET_S, default 560 s: it fits a 10-minute slot with room for the machine's own start).
#
#   bash benchmarks/gpu.sh OUT_DIR
#
# writes into OUT_DIR: env.txt (GPU, driver, torch), gpu_tests.log (pytest -m gpu: every precision
# mode on CUDA, DDP/FSDP over nccl, host syncs per step), compare_loops.md/.json (halfprec vs a
# raw loop vs Lightning vs Accelerate, per precision mode: ResNet-50, ViT-B/16 and a GPT-2-sized
# GPT; images/s, tokens/s, MFU, peak memory), memory.md/.json
# (peak memory per precision mode against the analytic estimate), formats.md (the emulated formats'
# ms/step and tokens/s against bf16 on the 124M GPT-2, batch 8 x 1024: its table alone, as the
# device tool brings back 8 files) and bench.log (the benchmarks' output): 8 files. The parts run in
# that order; each gets what the budget has left, less a reserve for the parts after it, and is
# killed 10 s after its limit if it ignores SIGTERM. compare_loops.py and memory.py rewrite their
# tables after every row, so a part cut short keeps what it measured, and its markdown then ends
# with a line saying so; formats.py writes its table at the end (cut short: bench.log has its rounds).
# On a machine without a GPU it says so, writes SKIPPED.md and exits 0. GPU_SH_REHEARSAL=1 runs
# the same steps on the CPU with the benchmarks' --quick rows: a check of this script, not a benchmark.
#
# An offline GPU machine whose Python lacks this project's pure-Python dependencies (hydra-core,
# omegaconf, antlr4; torchao for precision=fp8) can take them as wheels in .whl/ at the repo root; they are installed into
# a temp dir first. Make them here with: bash benchmarks/gpu.sh --wheels
set -uo pipefail
PY=${PYTHON:-python3}
BUDGET=${GPU_SH_BUDGET_S:-560}
REHEARSAL=${GPU_SH_REHEARSAL:-0}

if [ "${1:-}" = "--wheels" ]; then
    cd "$(dirname "$0")/.."
    # pure-Python wheels for the dependencies a bare CUDA image tends to lack (antlr4 ships no wheel: built here)
    mkdir -p .whl
    "$PY" -m pip wheel --no-deps -q -w .whl "hydra-core>=1.3.2,<1.4" "omegaconf>=2.3,<2.4" "antlr4-python3-runtime==4.9.3" torchao
    ls .whl
    exit 0
fi
[ -n "${1:-}" ] || { echo "usage: bash benchmarks/gpu.sh OUT_DIR   (or --wheels)" >&2; exit 2; }
out=$(realpath -m "$1") # before the cd below: a relative OUT_DIR is the caller's
cd "$(dirname "$0")/.."
mkdir -p "$out"

if [ -d .whl ] && ls .whl/*.whl > /dev/null 2>&1; then
    site=/tmp/halfprec-site
    if "$PY" -m pip --version > /dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl || exit 1
    else # a wheel is a zip of the files to import: unpacking it is the install
        for w in .whl/*.whl; do "$PY" -m zipfile -e "$w" "$site" || exit 1; done
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" WANDB_MODE=offline WANDB_SILENT=true PYTHONUNBUFFERED=1

device=cuda
if [ "$REHEARSAL" = 1 ]; then
    device=cpu
    export CUDA_VISIBLE_DEVICES="" # also on a GPU machine: the GPU tests skip
    echo "gpu.sh: rehearsal on the CPU (GPU_SH_REHEARSAL=1): quick rows, the GPU tests skip"
elif ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu.sh: no CUDA GPU visible here: GPU tests and benchmarks skipped" | tee "$out/SKIPPED.md"
    exit 0
fi
# everything the parts import, checked at once: a missing one fails here in seconds, not in each part
if ! "$PY" -c "import hydra, omegaconf, pytest, sklearn, timm, halfprec.training.run" 2> "$out/env.txt"; then
    cat "$out/env.txt" >&2
    echo "gpu.sh: a package is missing (above); hydra-core/omegaconf/antlr4/torchao travel as wheels: run 'bash benchmarks/gpu.sh --wheels' where pip works" >&2
    exit 1
fi

{
    date -u +"%Y-%m-%d %H:%M UTC"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv 2> /dev/null
    "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name() if torch.cuda.is_available() else 'no GPU')"
} > "$out/env.txt" 2>&1
cat "$out/env.txt"

status=0
# limit PART RESERVE: the seconds the budget has left, less RESERVE for the parts after this one
# (and the 10 s a killed part may take to die), at most PART
limit() {
    local left=$((BUDGET - SECONDS - $2 - 10))
    [ "$left" -lt "$1" ] || left=$1
    [ "$left" -gt 10 ] || left=10
    echo "$left"
}
# cut_short RC LIMIT FILE: a part stopped by `timeout` says so at the end of its table or log
cut_short() {
    if [ "$1" -eq 124 ]; then
        echo "gpu.sh: cut short at its ${2} s limit: what it had not finished is missing" | tee -a "$3" >&2
    elif [ "$1" -eq 137 ]; then # SIGKILL: timeout's, 10 s after the limit, or the kernel's (out of memory)
        echo "gpu.sh: killed (SIGKILL; its ${2} s limit was near): what it had not finished is missing" | tee -a "$3" >&2
    fi
}
quick=()
[ "$REHEARSAL" = 1 ] && quick=(--quick)
# "${quick[@]}" of an empty array is an unbound variable under set -u in bash < 4.4: this form is not

# 1. the GPU-marked tests (~2 min on one H200); `-o addopts`: pyproject's `-n auto` needs pytest-xdist,
# which the GPU machine may lack, and the GPU tests share one device: one process
t=$(limit 170 380)
timeout -k 10 "$t" "$PY" -m pytest tests/test_gpu.py -m gpu -q -p no:cacheprovider -o addopts=--strict-markers 2>&1 | tee "$out/gpu_tests.log"
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || status=1
cut_short "$rc" "$t" "$out/gpu_tests.log"

# bench SCRIPT MAX RESERVE [ARGS...]: one benchmark at --device, its tables in OUT_DIR (rewritten
# after every row, so a run cut short keeps what it measured), its whole output in bench.log
bench() {
    local name=${1%.py} t files
    t=$(limit "$2" "$3")
    files=(--json "$out/$name.json" --markdown "$out/$name.md")
    [ "$name" = formats ] && files=(--markdown "$out/$name.md") # the 8th file: no room for its JSON
    echo "gpu.sh: $1, limit $t s" | tee -a "$out/bench.log"
    timeout -k 10 "$t" "$PY" "benchmarks/$1" --device "$device" ${quick[@]+"${quick[@]}"} "${@:4}" \
        "${files[@]}" 2>&1 | tee -a "$out/bench.log" | tail -n 60
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || status=1
    cut_short "$rc" "$t" "$out/$name.md"
}
bench compare_loops.py 200 210 # 2. the loop comparison
bench memory.py 90 120         # 3. peak memory per precision mode against the estimate (~1 min)
# 4. the emulated formats on GPT-2 small (the rehearsal's --quick model instead): few short blocks
formats_args=(--steps 5 --repeats 3 --warmup 2)
[ "$REHEARSAL" = 1 ] || formats_args+=(--model gpt2)
bench formats.py 120 0 "${formats_args[@]}"

echo "gpu.sh: results in $out after $SECONDS s (exit $status)"
exit $status
