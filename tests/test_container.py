"""The Dockerfiles' contracts, checked without a container engine (CI has none; lab/container_check.py builds and
runs both images where podman is): multi-stage, a non-root user, a healthcheck that really tells ready from not, a
default command the CLI accepts, a build context that holds what the builds copy, torch pins the package allows, and
the CUDA image's entrypoint that refuses to run without a GPU, its JupyterLab and a HOME any uid can write."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from packaging.requirements import Requirement

from cifarkit.cli import build_parser
from conftest import ROOT
from servers import running_server

pytestmark = pytest.mark.e2e

DOCKERFILES = ["Dockerfile", "Dockerfile.cuda"]


def instructions(name: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) of each instruction, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / name).read_text())
    lines = (line.strip() for line in text.splitlines())
    return [(word.upper(), rest.strip()) for word, _, rest in
            (line.partition(" ") for line in lines if line and not line.startswith("#"))]


def final_stage(name: str) -> list[tuple[str, str]]:
    steps = instructions(name)
    last_from = max(i for i, (word, _) in enumerate(steps) if word == "FROM")
    return steps[last_from:]


def one(steps: list[tuple[str, str]], word: str) -> str:
    found = [rest for keyword, rest in steps if keyword == word]
    assert len(found) == 1, f"expected one {word}, found {found}"
    return found[0]


def healthcheck_command(name: str) -> list[str]:
    options, _, command = one(final_stage(name), "HEALTHCHECK").partition(" CMD ")
    assert "--start-period=" in options, "a healthcheck without a start period fails while the models load"
    return json.loads(command)


def torch_requirement() -> Requirement:
    return next(r for r in map(Requirement, metadata.requires("cifarkit")) if r.name == "torch")


@pytest.mark.parametrize("name", DOCKERFILES)
def test_multi_stage_non_root_with_a_healthcheck_and_a_command_the_cli_takes(name):
    assert sum(word == "FROM" for word, _ in instructions(name)) >= 2
    stage = final_stage(name)
    copies = [rest for word, rest in stage if word == "COPY"]
    assert any(rest.startswith("--from=build ") for rest in copies), "the final stage takes the venv from the build"
    user = one(stage, "USER")
    assert user not in ("root", "0") and not user.startswith("0:")
    command = json.loads(one(stage, "CMD"))
    assert command[0] == "cifarkit"
    build_parser().parse_args(command[1:])  # exits (and fails the test) on an argument the CLI does not take
    assert healthcheck_command(name)[0] == "python3"


@pytest.mark.parametrize("name", DOCKERFILES)
def test_the_build_context_admits_what_the_builds_copy_and_nothing_else(name):
    ignore = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert ignore[0] == "*", "an allowlist: .git, .venv and runs/ never reach the build"
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for word, rest in instructions(name):
        if word == "COPY" and not rest.startswith("--from"):
            *sources, _ = rest.split()
            for source in sources:
                assert source.rstrip("/") in admitted, f"{name} copies {source}, which .dockerignore leaves out"
                assert (ROOT / source).exists(), f"{name} copies {source}, which the checkout lacks"


def test_the_cpu_image_pins_a_torch_the_package_allows_and_the_cuda_base_carries_one():
    requirement = torch_requirement()
    pin = re.search(r"^ARG TORCH_VERSION=(\S+)$", (ROOT / "Dockerfile").read_text(), re.MULTILINE).group(1)
    assert requirement.specifier.contains(pin), f"Dockerfile's torch {pin} is outside pyproject's {requirement}"
    base = re.search(r"^ARG BASE=pytorch/pytorch:([\d.]+)-cuda", (ROOT / "Dockerfile.cuda").read_text(),
                     re.MULTILINE).group(1)
    assert requirement.specifier.contains(base), f"Dockerfile.cuda's base has torch {base}, outside {requirement}"


def test_the_serving_healthcheck_fails_until_a_server_is_ready_then_passes():
    stage = final_stage("Dockerfile")
    port = build_parser().parse_args(json.loads(one(stage, "CMD"))[1:]).port
    assert one(stage, "EXPOSE") == str(port)
    command = healthcheck_command("Dockerfile")
    assert f"127.0.0.1:{port}/readyz" in command[-1], "the healthcheck asks the port the command serves on"
    with running_server("--model", "B") as server:
        here = urlsplit(server.url).netloc
        probe = [sys.executable, *(part.replace(f"127.0.0.1:{port}", here) for part in command[1:])]
        assert subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
    # The same probe once the server is gone: the container would be marked unhealthy.
    assert subprocess.run(probe, capture_output=True, timeout=60).returncode != 0


def test_the_cuda_healthcheck_reports_a_container_without_a_gpu_as_unhealthy():
    import torch

    command = healthcheck_command("Dockerfile.cuda")
    result = subprocess.run([sys.executable, *command[1:]], capture_output=True, timeout=120)
    assert result.returncode == (0 if torch.cuda.is_available() else 1), result.stderr.decode()[-500:]


def cuda_entrypoint() -> list[str]:
    """Dockerfile.cuda's ENTRYPOINT, with the script that it copies into the image read from the checkout."""
    stage = final_stage("Dockerfile.cuda")
    *program, script = json.loads(one(stage, "ENTRYPOINT"))
    copies = [rest.split() for word, rest in stage if word == "COPY" and not rest.startswith("--from")]
    sources = [source for source, destination in copies
               if destination == script or destination.endswith("/") and destination + Path(source).name == script]
    assert len(sources) == 1, f"ENTRYPOINT runs {script}, which no COPY from the checkout puts there"
    return [*program, str(ROOT / sources[0])]


def test_the_cuda_image_refuses_to_start_without_a_gpu_unless_the_cpu_is_asked_for():
    import torch

    # The image's python3 is its venv's, first on PATH; here it is this test's.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("CIFARKIT_ALLOW_CPU", None)
    command = [*cuda_entrypoint(), "sh", "-c", "echo the command ran; exit 3"]
    refused = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    if torch.cuda.is_available():
        assert refused.returncode == 3 and "the command ran" in refused.stdout
    else:
        assert refused.returncode == 2 and not refused.stdout
        message = refused.stderr.strip().splitlines()[-1]
        assert message.startswith("cifarkit: error: this container sees no GPU; start it with --gpus all")
        assert "NVIDIA Container Toolkit" in message and "-e CIFARKIT_ALLOW_CPU=1" in message
    allowed = subprocess.run(command, capture_output=True, text=True, env={**env, "CIFARKIT_ALLOW_CPU": "1"},
                             timeout=120)
    assert allowed.returncode == 3 and allowed.stdout == "the command ran\n", allowed.stderr


def test_the_cuda_image_opens_the_notebook_in_jupyterlab_for_any_uid():
    steps, stage = instructions("Dockerfile.cuda"), final_stage("Dockerfile.cuda")
    pin = re.search(r"^ARG JUPYTERLAB_VERSION=(\S+)$", (ROOT / "Dockerfile.cuda").read_text(), re.MULTILINE)
    assert pin and any(word == "RUN" and '"jupyterlab==$JUPYTERLAB_VERSION"' in rest for word, rest in steps)
    home = one(stage, "WORKDIR")
    assert ["notebooks/quickstart.ipynb", "notebooks/"] in [rest.split() for word, rest in stage if word == "COPY"]
    assert (ROOT / "notebooks" / "quickstart.ipynb").is_file() and one(stage, "EXPOSE") == "8888"
    # `--user "$(id -u):$(id -g)"` gives a uid without a passwd entry: HOME must be named, and writable by anyone.
    assert f"HOME={home}" in one(stage, "ENV").split()
    assert any(word == "RUN" and f"chmod -R a+rwX {home}" in rest for word, rest in stage)
