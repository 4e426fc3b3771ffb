# cifarkit on the CPU: `cifarkit serve` with the shipped releases A and B, the web page and the API on port 8000.
#
#   docker build -t cifarkit .
#   docker run --rm -p 8000:8000 cifarkit          # then http://127.0.0.1:8000/
#   docker run --rm -v "$PWD/examples/images:/images:ro" cifarkit cifarkit predict /images/cat.png --topk 3
#
# Without a registry or PyPI (an air-gapped build): fill wheelhouse/ and build from a local base image with
# `--build-arg BASE=... --build-arg PIP_NO_INDEX=1`; `python lab/container_check.py` does all of it with podman.
# The CUDA variant is Dockerfile.cuda.

ARG BASE=python:3.11-slim-bookworm

# The build stage holds pip's downloads, the wheelhouse and the source; only the finished venv leaves it.
FROM ${BASE} AS build
# PyTorch's CPU-only wheels are a tenth of the size of PyPI's default (CUDA) build, which a CPU image never uses.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.14.1
ARG TORCHVISION_VERSION=0.29.1
# 1: install from wheelhouse/ alone (pip reads PIP_NO_INDEX from the build argument's environment).
ARG PIP_NO_INDEX=0
ENV PIP_FIND_LINKS=/wheelhouse PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1
RUN python3 -m venv /opt/venv
COPY wheelhouse/ /wheelhouse/
# torch first and in a layer of its own: it is most of the image, and a source change should not reinstall it.
RUN /opt/venv/bin/pip install --index-url "$TORCH_INDEX" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
COPY pyproject.toml README.md /src/
COPY src/ /src/src/
RUN /opt/venv/bin/pip install /src

FROM ${BASE} AS runtime
COPY --from=build /opt/venv /opt/venv
# A fixed non-root uid, so that mounted folders can be given to it.
RUN useradd --create-home --uid 10001 cifarkit
USER cifarkit
WORKDIR /home/cifarkit
ENV PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
EXPOSE 8000
# Healthy once every model is loaded and warm: /readyz answers 503 until then, and the start period covers loading.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/readyz', timeout=4)"]
# 0.0.0.0 inside the container's own network namespace; `docker run -p` decides what the host exposes.
CMD ["cifarkit", "serve", "--host", "0.0.0.0", "--port", "8000"]
