#!/bin/sh
# Dockerfile.cuda's entrypoint. A container started without a GPU (no `--gpus all`, or a host without the NVIDIA
# Container Toolkit) would train on the CPU, quietly and for hours: it stops at once instead, unless
# CIFARKIT_ALLOW_CPU=1 asks for the CPU on purpose (`cifarkit env` to see why, a look at the notebook).
# torch answers, not a look at /dev/nvidia*: a driver too old for the image's CUDA also fails here, after torch's
# warning that says so.
if [ "${CIFARKIT_ALLOW_CPU:-0}" != 1 ] && ! python3 -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'
then
    echo "cifarkit: error: this container sees no GPU; start it with --gpus all (the host needs the NVIDIA Container" \
         "Toolkit), or with -e CIFARKIT_ALLOW_CPU=1 to run on the CPU on purpose" >&2
    exit 2
fi
exec "$@"
