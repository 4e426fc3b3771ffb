"""The Dockerfiles' contracts, checked without a container engine (CI has none; lab/container_check.py builds and
runs the CPU image where podman is): multi-stage, a non-root user, a healthcheck that really tells ready from not, a
default command the CLI accepts, a build context that holds what the builds copy, and torch pins the package allows."""
from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
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
    assert "--from=build" in one(stage, "COPY"), "the final stage takes the built venv from the build stage"
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
