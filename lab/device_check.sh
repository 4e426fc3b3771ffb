#!/usr/bin/env bash
# Every GPU check of this project in one run, for a machine with CUDA; sized for one 15-minute lease of a GPU.
#
#     bash lab/device_check.sh [OUT_DIR]        # default OUT_DIR: device-check
#
# 1. `cifarkit bench --devices cpu cuda`: fastnet and the GPU-vs-CPU study's cifar10net, in fp32 and in amp (fp16 +
#    GradScaler on CUDA), training and inference img/s, epoch time, peak memory, speed-ups over this machine's CPU in
#    fp32 -> OUT_DIR/bench-devices.json. Each configuration is a process of its own, so the models are few: with the
#    write-ups' four, the report alone outran a lease's share (docs/measurements.md).
# 2. With the real CIFAR-10 at hand (CIFARKIT_DATA, or the cache of `cifarkit data import`): the fast recipe's speed
#    run on CUDA, 3 seeds, and a timed slice of resnet18-sgd (2 of its 200 epochs) -> OUT_DIR/speedrun-fast-cuda.json,
#    OUT_DIR/resnet18-sgd-2-epochs.json. Without it they are skipped, and the script says so.
# 3. Last, with the data and a copy of airbench94_muon.py in the project root (MUON overrides; how to get it:
#    `cifarkit reference` without --muon prints the command): the reference as its author runs it, compiled with
#    max-autotune, whose warm-up alone takes minutes -> OUT_DIR/airbench94-muon-cuda.json.
# DEVICE_CHECK_SKIP_REPORT=1 skips step 1, for a second call in the same lease that brings the data.
# A step that fails is reported and the next one runs: one lease of a GPU is too short to lose the rest to it.
# Works from a clone without installing cifarkit: its src/ goes on PYTHONPATH when `import cifarkit` fails.
set -uo pipefail
cd "$(dirname "$0")/.."
out=$(mkdir -p "${1:-device-check}" && cd "${1:-device-check}" && pwd)
python=${PYTHON:-python3}
if ! "$python" -c "import cifarkit" 2>/dev/null; then
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
fi
"$python" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else
    'device_check: torch sees no CUDA device here; run this on a machine with an NVIDIA GPU')"
cifarkit() { "$python" -m cifarkit "$@"; }
export PYTHONUNBUFFERED=1

failed=()
step() {  # step NAME COMMAND...: run it, time it, and carry on if it fails
    local name=$1 start=$SECONDS
    shift
    "$@" || failed+=("$name")
    echo "device_check: $name took $((SECONDS - start)) s"
}
summary() {
    if ((${#failed[@]})); then echo "device_check: FAILED: ${failed[*]}"; exit 1; fi
    echo "device_check: every step passed"
}

[[ -n "${DEVICE_CHECK_SKIP_REPORT:-}" ]] ||
    step "the device report" cifarkit bench --devices cpu cuda \
    --models cifar10net fastnet --steps 5 --rounds 2 --json "$out/bench-devices.json"

if [[ -z "${CIFARKIT_DATA:-}" ]] && ! "$python" -c "import sys; from cifarkit import data
sys.exit(0 if data.cache_path().is_file() else 1)"; then
    echo "device_check: skipped the speed runs: no CIFAR-10 here; set CIFARKIT_DATA to cifar-10-python.tar.gz"
    summary
    exit
fi
runs=$(mktemp -d)
step "3 fast runs on CUDA" cifarkit speedrun --recipe fast --runs 3 --target 0.94 --device cuda --no-curve \
    --out "$runs/fast" --json "$out/speedrun-fast-cuda.json"
step "2 epochs of resnet18-sgd on CUDA" cifarkit train --recipe resnet18-sgd --epochs 2 --device cuda \
    --out "$runs/resnet18-sgd"
cp "$runs/resnet18-sgd/summary.json" "$out/resnet18-sgd-2-epochs.json" 2>/dev/null
muon=${MUON:-airbench94_muon.py}
if [[ -f "$muon" ]]; then
    step "airbench94_muon on CUDA" "$python" lab/reference_cuda.py --muon "$muon" --runs 3 \
        --json "$out/airbench94-muon-cuda.json"
else
    echo "device_check: skipped airbench94_muon: no $muon (cifarkit reference without --muon prints how to get it)"
fi
summary
