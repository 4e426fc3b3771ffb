#!/usr/bin/env bash
# Every GPU check of this project in one run, for a machine with CUDA; sized for about 8 minutes on one H200.
#
#     bash scripts/device_check.sh [OUT_DIR]        # default OUT_DIR: device-check
#
# 1. `cifarkit bench --devices cpu cuda`: every model in fp32 and in amp (fp16 + GradScaler on CUDA), training and
#    inference img/s, epoch time, peak memory, speed-ups over this machine's CPU in fp32 -> OUT_DIR/bench-devices.*
# 2. With the real CIFAR-10 at hand (CIFARKIT_DATA, or the cache of `cifarkit data import`): the fast recipe's speed
#    run on CUDA, 3 seeds, and a timed slice of resnet18-sgd (2 of its 200 epochs) -> OUT_DIR/speedrun-fast-cuda.json,
#    OUT_DIR/resnet18-sgd-2-epochs.json. Without it they are skipped, and the script says so.
# Works from a clone without installing cifarkit: its src/ goes on PYTHONPATH when `import cifarkit` fails.
set -euo pipefail
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

start=$SECONDS
cifarkit bench --devices cpu cuda --steps 5 --rounds 2 --json "$out/bench-devices.json"
echo "device_check: the device report took $((SECONDS - start)) s"

if [[ -z "${CIFARKIT_DATA:-}" ]] && ! "$python" -c "import sys; from cifarkit import data
sys.exit(0 if data.cache_path().is_file() else 1)"; then
    echo "device_check: skipped the speed runs: no CIFAR-10 here; set CIFARKIT_DATA to cifar-10-python.tar.gz"
    exit 0
fi
runs=$(mktemp -d)
start=$SECONDS
cifarkit speedrun --recipe fast --runs 3 --target 0.94 --device cuda --no-curve --out "$runs/fast" \
    --json "$out/speedrun-fast-cuda.json"
echo "device_check: 3 fast runs on CUDA took $((SECONDS - start)) s"
start=$SECONDS
cifarkit train --recipe resnet18-sgd --epochs 2 --device cuda --out "$runs/resnet18-sgd"
cp "$runs/resnet18-sgd/summary.json" "$out/resnet18-sgd-2-epochs.json"
echo "device_check: 2 epochs of resnet18-sgd on CUDA took $((SECONDS - start)) s"
