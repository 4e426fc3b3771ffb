#!/usr/bin/env bash
# Every GPU check of this project in one run, for a machine with CUDA; sized for one lease of a GPU (at most 9
# minutes on an H100 or H200: DEVICE_CHECK_BUDGET_S, default 540, skips the steps that would start after it).
#
#     bash lab/device_check.sh [OUT_DIR]        # default OUT_DIR: device-check
#
# Most valuable first, each step a command a user could run, writing OUT_DIR/*.json:
# 1. `python lab/check_cuda_steps.py`: fast's training steps under torch.cuda.set_sync_debug_mode("error"), after
#    the warm-up: no step may make the host wait for the GPU -> cuda-steps.json.
# 2. `cifarkit speedrun --device cuda`: fast as shipped on CUDA (auto: bf16 on Ampere and later, compiled, warmed up
#    before the clock, no checkpoints), 5 seeds -> speedrun-fast-cuda.json; then with CUDA graphs (torch.compile's
#    reduce-overhead mode), 3 seeds, to decide whether they pay -> speedrun-fast-cuda-graphs.json.
# 3. The references on the same GPU, each the author's own script run by `lab/reference_cuda.py` with its own
#    torch.compile calls, in the compiler's default mode (max-autotune's warm-up alone outruns a lease), 5 runs each:
#    airbench94_muon.py and the 2025 record's cifar10_speedrun.py, where their copies are in the project root (MUON,
#    RECORD override) -> airbench94_muon-cuda.json, cifar10_speedrun-cuda.json.
# 4. Inference and serving on the GPU: `cifarkit predict --device cuda` with auto and each torch backend, release
#    B's test accuracy on CUDA (`cifarkit eval`), a fixed-shape fp16 TensorRT engine where the tensorrt package is
#    installed (`cifarkit export --format tensorrt`, its parity checked), and the server on the GPU
#    (`cifarkit bench-serve --serve-args '--device cuda'`) -> predict-cuda-*.json, eval-B-cuda.json, tensorrt/,
#    serve-bench-cuda.json. Then the releases' backends measured on CUDA, which `auto` there needs before it may
#    choose fp16 or bf16 (`lab/measure_release_backends.py --device cuda`: it rewrites the releases' metrics.json in
#    this checkout; copied to OUT_DIR/releases/).
# 5. `cifarkit bench --devices cpu cuda`, the write-ups' three models (CIFAR10Net, SimpleCNN, ResNet-18), one
#    round: CPU against GPU epoch time and speed-up, fp32 against amp with peak GPU memory, and amp once more with
#    cuDNN autotuning off -> bench-devices.json.
# Steps 1-3 and the evaluations of 4 need the real CIFAR-10 (CIFARKIT_DATA, or the cache that `lab/carry_data.py
# unpack` rebuilds); without it they are skipped, and the script says so.
# DEVICE_CHECK_PARTS picks the parts, in this order: training (1-3), inference (4), tables (5); default all three.
# A second call in the same lease gives the parts the first one's budget skipped.
# A step that fails is reported and the next one runs: one lease of a GPU is too short to lose the rest to it.
# Works from a clone without installing cifarkit: its src/ goes on PYTHONPATH when `import cifarkit` fails.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-device-check}" && cd "${1:-device-check}" && pwd)
python=${PYTHON:-python3}
budget=${DEVICE_CHECK_BUDGET_S:-540}
if ! "$python" -c "import cifarkit" 2>/dev/null; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else
    'device_check: torch sees no CUDA device here; run this on a machine with an NVIDIA GPU')" || exit 1
cifarkit() { "$python" -m cifarkit "$@"; }
export PYTHONUNBUFFERED=1

failed=()
skipped=()
step() {  # step NAME COMMAND...: run it unless the budget is spent, time it, and carry on if it fails
    local name=$1 start=$SECONDS
    shift
    if ((SECONDS >= budget)); then
        skipped+=("$name")
        echo "device_check: skipped $name: the ${budget} s budget is spent"
        return
    fi
    "$@" || failed+=("$name")
    echo "device_check: $name took $((SECONDS - start)) s"
}
summary() {
    ((${#skipped[@]})) && echo "device_check: not run, out of time: ${skipped[*]}"
    if ((${#failed[@]})); then echo "device_check: FAILED: ${failed[*]}"; exit 1; fi
    echo "device_check: every step that ran passed, in $SECONDS s"
}

parts=" ${DEVICE_CHECK_PARTS:-training inference tables} "
has_data() {
    [[ -n "${CIFARKIT_DATA:-}" ]] || "$python" -c "import sys; from cifarkit.data import cifar10
sys.exit(0 if cifar10.cache_path().is_file() else 1)"
}
predict_each_backend() {
    local backend
    for backend in auto torch-fp32 torch-bf16 torch-fp16; do
        cifarkit predict examples/images/*.png --topk 3 --device cuda --backend "$backend" --json \
            >"$out/predict-cuda-$backend.json" || return 1
    done
}
eval_on_cuda() {
    cifarkit eval B --device cuda --json >"$out/eval-B-cuda.json"
}
release_backends_on_cuda() {
    "$python" lab/measure_release_backends.py --real-data "$CIFARKIT_DATA" --device cuda &&
        mkdir -p "$out/releases" &&
        for release in src/cifarkit/pretrained/version_*; do
            cp "$release/metrics.json" "$out/releases/$(basename "$release")-metrics.json"
        done
}

cifarkit env | tee "$out/env.txt"
if [[ $parts != *" training "* ]]; then
    :
elif has_data; then
    step "fast's steps never wait for the GPU" "$python" lab/check_cuda_steps.py --recipe fast --steps 20 \
        --json "$out/cuda-steps.json"
    runs=$(mktemp -d)
    step "fast on CUDA, 5 seeds" cifarkit speedrun --recipe fast --runs 5 --target 0.94 --device cuda --no-curve \
        --out "$runs/fast" --json "$out/speedrun-fast-cuda.json"
    step "fast on CUDA with CUDA graphs, 3 seeds" cifarkit speedrun --recipe fast --runs 3 --target 0.94 \
        --device cuda --no-curve --set train.compile_mode=reduce-overhead --out "$runs/fast-graphs" \
        --json "$out/speedrun-fast-cuda-graphs.json"
    for reference in airbench94_muon cifar10_speedrun; do
        case $reference in
            airbench94_muon) copy=${MUON:-airbench94_muon.py} ;;
            cifar10_speedrun) copy=${RECORD:-cifar10_speedrun.py} ;;
        esac
        if [[ -f "$copy" ]]; then
            step "$reference on CUDA" "$python" lab/reference_cuda.py --reference "$reference" --file "$copy" \
                --runs 5 --compile-mode default --json "$out/$reference-cuda.json"
        else
            echo "device_check: skipped $reference: no $copy (cifarkit reference without --muon or --record prints" \
                 "how to get it)"
        fi
    done
else
    echo "device_check: skipped the training steps: no CIFAR-10 here; set CIFARKIT_DATA to cifar-10-python.tar.gz" \
         "or carry the cache with lab/carry_data.py"
fi
if [[ $parts == *" inference "* ]]; then
    step "predict on CUDA, auto and each torch backend" predict_each_backend
    if has_data; then
        step "release B's test accuracy on CUDA" eval_on_cuda
    fi
    if "$python" -c "import tensorrt" 2>/dev/null; then
        step "a TensorRT engine of release B" cifarkit export B --format tensorrt --out "$out/tensorrt"
    else
        echo "device_check: skipped the TensorRT export: no tensorrt package here (pip install tensorrt)"
    fi
    step "the server on CUDA" cifarkit bench-serve --model B --requests 2000 --concurrency 1 16 64 --warmup 200 \
        --soak-s 0 --serve-args "--device cuda" --out "$out/serve-bench-cuda.json"
    if [[ -n "${CIFARKIT_DATA:-}" ]]; then
        step "the releases' backends on CUDA" release_backends_on_cuda
    else
        echo "device_check: skipped the releases' backends on CUDA: they need CIFARKIT_DATA, the archive itself"
    fi
fi
if [[ $parts == *" tables "* ]]; then
    step "the device report" cifarkit bench --devices cpu cuda --models cifar10net simplecnn resnet18 --rounds 1 \
        --json "$out/bench-devices.json"
fi
summary
