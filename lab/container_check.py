"""Build the images from `Dockerfile` and `Dockerfile.cuda`, start them, and get predictions and a finished training
from them: the check that the containers work.

    python lab/container_check.py --json results/container-check.json

It uses podman (Debian: `apt-get install podman runc debootstrap`), and needs no registry and no network inside
the builds:
1. The base image. `--base IMAGE` names one that podman already has. Otherwise Debian bookworm (Python 3.11, as in
   the Dockerfile's default python:3.11-slim-bookworm) is made by debootstrap (as root) and imported as
   localhost/cifarkit-base:bookworm, once; later runs reuse it.
2. The wheelhouse: `pip wheel` of the project's dependencies, with the Dockerfiles' torch, torchvision and JupyterLab
   pins, from this machine's indexes into wheelhouse/.
3. The CPU image: `podman build --network none` with PIP_NO_INDEX=1, so every package comes from the wheelhouse.
   It runs with its own command (`cifarkit serve` on port 8000), published on a free loopback port. Its HEALTHCHECK
   is run until it passes (podman runs healthchecks from systemd timers, which this machine lacks, so the check
   calls `podman healthcheck run`); then this process posts the example pictures to /v1/predict.
4. The CUDA image (unless --no-cuda). Its official base cannot be pulled here, so it is built on a stand-in: the
   base of step 1 with torch and torchvision in the system's site-packages, where the PyTorch image keeps them. The
   stand-in checks the Dockerfile's own steps (the venv that reuses the base's torch, the entrypoint, the user, the
   volumes, JupyterLab), not NVIDIA's libraries. Without a GPU, its entrypoint must refuse `cifarkit train` with
   the one-line error. With CIFARKIT_ALLOW_CPU=1 and as a uid the image does not know, as `--user "$(id -u):$(id -g)"`
   runs it for a bind mount: `cifarkit train` trains SimpleCNN for one epoch on 1,000 images of this machine's
   CIFAR-10 cache (mounted read-only) into a mounted runs folder that uid owns, and `jupyter lab --ip 0.0.0.0`,
   published on loopback, must list the quickstart notebook and a Python kernel. Last, its healthcheck must say
   whether it sees a GPU.
5. A summary on stdout, and with --json, the figures as JSON.

Any failure ends the check with a one-line error naming the log that holds the details.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WHEELHOUSE = ROOT / "wheelhouse"
EXAMPLES = ROOT / "src" / "cifarkit" / "serving" / "web" / "examples"
DEFAULT_BASE = "localhost/cifarkit-base:bookworm"
TORCH_STANDIN = "localhost/cifarkit-torch-standin:bookworm"
CONTAINER_PORT = 8000
USER_HOME = "/home/cifarkit"
HOST_USER = "4242:4242"  # a host user's uid and gid, as `--user` passes them: not the image's user, in no passwd
ALLOW_CPU = ["--env", "CIFARKIT_ALLOW_CPU=1"]  # past Dockerfile.cuda's entrypoint, which stops a container without GPU
# Docker adds no passwd entry for a `--user` uid, where podman would: without one, the image must still work.
AS_HOST_USER = ["--user", HOST_USER, "--passwd=false"]
JUPYTER = ["jupyter", "lab", "--ip", "0.0.0.0"]  # as the docs run it
JUPYTER_PORT = 8888
JUPYTER_TOKEN = "container-check"
TRAINING = ["cifarkit", "train", "--recipe", "simplecnn", "--subset", "1000", "--epochs", "1"]  # seconds, not hours

# podman as root raises a container's open-files limit to 1M by default; a sandboxed host that forbids raising it
# fails every `run` and `RUN` step with "error setting rlimit type 7". An empty list keeps the host's limit.
CONTAINERS_CONF = "[containers]\ndefault_ulimits = []\n"

# The PyTorch image's layout, as far as Dockerfile.cuda relies on it: python3 with torch and torchvision importable.
# The wheelhouse is bound for the one step, not copied, so that the stand-in does not carry it.
STANDIN_FILE = """FROM {base}
RUN --mount=type=bind,source=wheelhouse,target=/wheelhouse \\
    python3 -m venv /tmp/pip && /tmp/pip/bin/pip install --no-index --find-links /wheelhouse --no-cache-dir \\
      --target /usr/local/lib/python{python}/dist-packages torch=={torch} torchvision=={torchvision} \\
    && rm -rf /tmp/pip
"""


class CheckFailed(RuntimeError):
    pass


def run(cmd: list[str], log: Path, stdin=None) -> str:
    """Run a command, append its output to the log, and return its stdout; a failure names the command and log."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=out, stdin=stdin, text=True)
        out.write(proc.stdout)
    if proc.returncode:
        raise CheckFailed(f"`{' '.join(cmd[:3])} ...` failed with exit code {proc.returncode}; see {log}")
    return proc.stdout


def succeeds(cmd: list[str]) -> bool:
    return subprocess.run(cmd, capture_output=True).returncode == 0


def dockerfile_arg(name: str, dockerfile: str = "Dockerfile") -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", (ROOT / dockerfile).read_text(), re.MULTILINE)
    if not match:
        raise CheckFailed(f"{dockerfile} has no `ARG {name}=...` line; the check reads the wheelhouse's pins from it")
    return match.group(1)


def make_base(tag: str, mirror: str, log: Path) -> float:
    """Debian bookworm with python3 and venv, from debootstrap, imported into podman; returns the seconds it took."""
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cifarkit-rootfs-") as rootfs:
        run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv", "bookworm", rootfs, mirror], log)
        # apt's package cache and lists are a base image's dead weight, as in Debian's own images.
        run(["sh", "-c", f"rm -rf {rootfs}/var/cache/apt/archives/*.deb {rootfs}/var/lib/apt/lists/*"], log)
        tar = subprocess.Popen(["tar", "-C", rootfs, "-c", "."], stdout=subprocess.PIPE)
        run(["podman", "import", "--change", 'CMD ["/bin/bash"]', "-", tag], log, stdin=tar.stdout)
        if tar.wait():
            raise CheckFailed(f"tar of the debootstrap folder failed; see {log}")
    return time.perf_counter() - start


def fill_wheelhouse(log: Path) -> dict:
    start = time.perf_counter()
    pins = [f"torch=={dockerfile_arg('TORCH_VERSION')}", f"torchvision=={dockerfile_arg('TORCHVISION_VERSION')}",
            f"jupyterlab=={dockerfile_arg('JUPYTERLAB_VERSION', 'Dockerfile.cuda')}"]
    # setuptools is the project's build backend: an offline `pip install /src` needs it from the wheelhouse too.
    run([sys.executable, "-m", "pip", "wheel", "--quiet", "--wheel-dir", str(WHEELHOUSE), *pins, str(ROOT),
         "setuptools>=68"], log)
    for own in WHEELHOUSE.glob("cifarkit-*.whl"):
        own.unlink()  # the images build the package from src/, not from a wheel of this checkout's last state
    wheels = list(WHEELHOUSE.glob("*.whl"))
    return {"wheels": len(wheels), "mib": round(sum(w.stat().st_size for w in wheels) / 2**20),
            "seconds": round(time.perf_counter() - start, 1)}


def build(dockerfile: str, base: str, tag: str, log: Path) -> dict:
    """An offline build from the wheelhouse, without the layer cache (the check is that the Dockerfile builds, not
    that a cache still holds what it once built) and without keeping the build stage's image, which holds the
    wheelhouse; the image's size, user, command and healthcheck."""
    start = time.perf_counter()
    # Docker's image format keeps HEALTHCHECK, for which the OCI format has no field.
    run(["podman", "build", "--no-cache", "--layers=false", "--format", "docker", "--network", "none",
         "--build-arg", f"BASE={base}", "--build-arg", "PIP_NO_INDEX=1", "--tag", tag, "--file", str(ROOT / dockerfile),
         str(ROOT)], log)
    seconds = time.perf_counter() - start
    image = json.loads(run(["podman", "image", "inspect", tag], log))[0]
    healthcheck = (image.get("Healthcheck") or {}).get("Test")
    if not healthcheck:
        raise CheckFailed(f"{tag} has no HEALTHCHECK: {dockerfile}'s was lost in the build")
    return {"dockerfile": dockerfile, "tag": tag, "base": base, "build_seconds": round(seconds, 1),
            "image_mib": round(image["Size"] / 2**20), "user": image["Config"].get("User"),
            "cmd": image["Config"].get("Cmd"), "healthcheck": healthcheck}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def top_prediction(port: int, picture: Path) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/predict", data=picture.read_bytes(),
                                     headers={"Content-Type": "image/png"}, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        body = json.load(response)
    answer = body["predictions"][0]
    return {"model": body["model"], "label": answer["label"], "confidence": round(answer["confidence"], 4)}


def wait_until(name: str, ready, what: str, timeout: float, log: Path) -> float:
    """Seconds until `ready()` says yes, while the container runs; `what` names the state, for the error."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        state = subprocess.run(["podman", "inspect", "--format", "{{.State.Status}}", name], capture_output=True,
                               text=True).stdout.strip()
        if state != "running":
            raise CheckFailed(f"the container stopped ({state}) before it was {what}; its output is in {log}")
        if ready():
            return time.perf_counter() - start
        time.sleep(1)
    raise CheckFailed(f"the container was not {what} within {timeout:g} s; its output is in {log}")


def remove(name: str, log: Path) -> None:
    with log.open("a") as out:
        subprocess.run(["podman", "logs", name], stdout=out, stderr=out)
    subprocess.run(["podman", "rm", "--force", name], capture_output=True)


def check_serving(tag: str, timeout: float, log: Path) -> dict:
    """The image's own command, published on loopback: healthy, not root, and answering /v1/predict."""
    name = f"cifarkit-check-serve-{os.getpid()}"
    port = free_port()
    start = time.perf_counter()
    run(["podman", "run", "--detach", "--name", name, "--publish", f"127.0.0.1:{port}:{CONTAINER_PORT}", tag], log)
    try:
        healthy = wait_until(name, lambda: succeeds(["podman", "healthcheck", "run", name]), "healthy", timeout, log)
        uid = int(run(["podman", "exec", name, "id", "-u"], log))
        if uid == 0:
            raise CheckFailed("the serving container runs as root: the Dockerfile's USER was lost")
        predictions = {picture.name: top_prediction(port, picture) for picture in sorted(EXAMPLES.glob("*.png"))}
        return {"uid": uid, "healthy_seconds": round(healthy, 1),
                "start_to_answers_seconds": round(time.perf_counter() - start, 1), "predictions": predictions}
    finally:
        remove(name, log)


def make_torch_standin(base: str, python: str, work: Path, log: Path) -> float:
    start = time.perf_counter()
    recipe = work / "Containerfile.standin"
    recipe.write_text(STANDIN_FILE.format(base=base, python=python, torch=dockerfile_arg("TORCH_VERSION"),
                                          torchvision=dockerfile_arg("TORCHVISION_VERSION")))
    run(["podman", "build", "--network", "none", "--tag", TORCH_STANDIN, "--file", str(recipe), str(ROOT)], log)
    return time.perf_counter() - start


def check_training(tag: str, data: Path, log: Path) -> dict:
    """Without a GPU the image's entrypoint refuses `cifarkit train` with its one-line error. With the CPU asked for,
    `cifarkit train` as a host user's uid, data read-only, the run written to a mounted folder that uid owns; then
    whether the image's healthcheck tells that no GPU is visible."""
    refused = subprocess.run(["podman", "run", "--rm", "--network", "none", tag, *TRAINING], capture_output=True,
                             text=True)
    with log.open("a") as out:
        out.write(f"\n$ podman run {tag} {' '.join(TRAINING)}  # no GPU\n{refused.stdout}{refused.stderr}")
    error = (refused.stderr.strip().splitlines() or ["(nothing)"])[-1]
    if refused.returncode == 0 or "--gpus all" not in error:
        raise CheckFailed(f"without a GPU the CUDA image did not refuse to train: exit code {refused.returncode}, "
                          f"last line {error!r}")
    with tempfile.TemporaryDirectory(prefix="cifarkit-runs-") as runs:
        os.chown(runs, *map(int, HOST_USER.split(":")))  # the host user's folder, as `mkdir -p runs` makes it
        start = time.perf_counter()
        run(["podman", "run", "--rm", "--network", "none", *ALLOW_CPU, *AS_HOST_USER, "--volume",
             f"{data}:{USER_HOME}/.cache/cifarkit:ro", "--volume", f"{runs}:{USER_HOME}/runs", tag, *TRAINING,
             "--out", "runs/check"], log)
        seconds = time.perf_counter() - start
        summary_file = Path(runs) / "check" / "summary.json"
        if not summary_file.exists():
            raise CheckFailed(f"the training in the container wrote no summary.json; its output is in {log}")
        summary = json.loads(summary_file.read_text())
        owner = summary_file.stat().st_uid
    name = f"cifarkit-check-gpu-{os.getpid()}"
    run(["podman", "run", "--detach", "--name", name, "--network", "none", *ALLOW_CPU, tag, "sleep", "600"], log)
    try:
        sees_gpu = succeeds(["podman", "healthcheck", "run", name])
    finally:
        remove(name, log)
    return {"refused_without_gpu": error, "command": " ".join(TRAINING), "user": HOST_USER, "files_uid": owner,
            "seconds": round(seconds, 1), "device": summary["device"], "precision": summary["precision"],
            "test_acc": summary["test_acc"], "dataset_sha256": summary["dataset_sha256"],
            "healthcheck_passes": sees_gpu}


def jupyter_get(port: int, path: str) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}",
                                     headers={"Authorization": f"token {JUPYTER_TOKEN}"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.load(response)


def answers(port: int, path: str) -> bool:
    try:
        jupyter_get(port, path)
    except OSError:  # refused or reset while the server starts; an HTTP error too, until the timeout names it
        return False
    return True


def check_jupyter(tag: str, timeout: float, log: Path) -> dict:
    """The documented `jupyter lab --ip 0.0.0.0` as a host user's uid, published on loopback: it must list the
    quickstart notebook and a Python kernel."""
    name = f"cifarkit-check-jupyter-{os.getpid()}"
    port = free_port()
    notebook = "/api/contents/notebooks/quickstart.ipynb?content=0"
    run(["podman", "run", "--detach", "--name", name, *ALLOW_CPU, *AS_HOST_USER, "--publish",
         f"127.0.0.1:{port}:{JUPYTER_PORT}", tag, *JUPYTER, f"--IdentityProvider.token={JUPYTER_TOKEN}"], log)
    try:
        seconds = wait_until(name, lambda: answers(port, notebook), "answering with the notebook", timeout, log)
        return {"command": " ".join(JUPYTER), "user": HOST_USER, "answered_seconds": round(seconds, 1),
                "notebook": jupyter_get(port, notebook)["path"],
                "kernels": sorted(jupyter_get(port, "/api/kernelspecs")["kernelspecs"])}
    finally:
        remove(name, log)


def check(args, work: Path, log: Path) -> dict:
    result = {"engine": subprocess.run(["podman", "--version"], capture_output=True, text=True).stdout.strip()}
    base = args.base or DEFAULT_BASE
    exists = succeeds(["podman", "image", "exists", base])
    if args.base and not exists:
        raise CheckFailed(f"podman has no image {args.base!r}; pull or import it, or leave out --base")
    made_seconds = None if exists else round(make_base(base, args.mirror, log), 1)
    python = run(["podman", "run", "--rm", "--network", "none", base, "python3", "-c",
                  "import sys; print('%d.%d' % sys.version_info[:2])"], log).strip()
    here = "%d.%d" % sys.version_info[:2]
    if python != here:
        raise CheckFailed(f"the base has Python {python} but this script's wheels would be for {here}: "
                          f"run it with python{python}")
    result["base"] = {"image": base, "python": python, "made_seconds": made_seconds,
                      "made_by": "given (--base)" if args.base else
                      "debootstrap --variant=minbase --include=python3,python3-venv bookworm, podman import"}
    result["wheelhouse"] = fill_wheelhouse(log)
    result["cpu"] = build("Dockerfile", base, "localhost/cifarkit:cpu", log)
    result["cpu"]["serving"] = check_serving("localhost/cifarkit:cpu", args.ready_timeout, log)
    if args.no_cuda:
        return result
    data = Path(args.data)
    if not (data / "cifar10.safetensors").exists():
        raise CheckFailed(f"{data} holds no CIFAR-10 cache: run `cifarkit data import ARCHIVE` first, or pass "
                          f"--no-cuda")
    standin_seconds = make_torch_standin(base, python, work, log)
    result["cuda"] = build("Dockerfile.cuda", TORCH_STANDIN, "localhost/cifarkit:cuda-standin", log)
    result["cuda"]["standin_seconds"] = round(standin_seconds, 1)
    result["cuda"]["training"] = check_training("localhost/cifarkit:cuda-standin", data, log)
    result["cuda"]["jupyter"] = check_jupyter("localhost/cifarkit:cuda-standin", args.ready_timeout, log)
    return result


def summary_lines(result: dict) -> list[str]:
    cpu = result["cpu"]
    lines = [f"{result['engine']}; base {result['base']['image']} (Python {result['base']['python']}); wheelhouse "
             f"{result['wheelhouse']['wheels']} wheels, {result['wheelhouse']['mib']:,} MiB",
             f"CPU image {cpu['tag']}: built offline in {cpu['build_seconds']:.0f} s, {cpu['image_mib']:,} MiB, "
             f"user {cpu['user']} (uid {cpu['serving']['uid']}), command {' '.join(cpu['cmd'])}",
             f"  healthy {cpu['serving']['healthy_seconds']:.1f} s after start; all answers "
             f"{cpu['serving']['start_to_answers_seconds']:.1f} s after start"]
    lines += [f"  {name}: {p['label']} ({p['confidence']:.1%})" for name, p in cpu["serving"]["predictions"].items()]
    if "cuda" in result:
        cuda, training, jupyter = result["cuda"], result["cuda"]["training"], result["cuda"]["jupyter"]
        lines += [f"CUDA image {cuda['tag']} on {cuda['base']}: built offline in {cuda['build_seconds']:.0f} s, "
                  f"{cuda['image_mib']:,} MiB, user {cuda['user']}, command {' '.join(cuda['cmd'])}",
                  f"  without a GPU: {training['refused_without_gpu']}",
                  f"  {training['command']} as {training['user']}: {training['seconds']:.0f} s, "
                  f"{training['device']} {training['precision']}, test acc {training['test_acc']:.2%}, files of uid "
                  f"{training['files_uid']}; healthcheck (sees a GPU) "
                  f"{'passes' if training['healthcheck_passes'] else 'fails'}",
                  f"  {jupyter['command']} as {jupyter['user']}: answered in {jupyter['answered_seconds']:.1f} s with "
                  f"{jupyter['notebook']}, kernels {', '.join(jupyter['kernels'])}"]
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base", help=f"a base image podman has (default: {DEFAULT_BASE}, made once by debootstrap)")
    parser.add_argument("--mirror", default="http://deb.debian.org/debian", help="Debian mirror for debootstrap")
    parser.add_argument("--ready-timeout", type=float, default=300, help="seconds for the server to be healthy")
    parser.add_argument("--no-cuda", action="store_true", help="check the CPU image alone")
    parser.add_argument("--data", default=None, help="cifarkit's cache folder with the imported CIFAR-10, for the "
                                                      "training in the CUDA image (default: CIFARKIT_HOME)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("error: run as root: podman's root storage and debootstrap need it", file=sys.stderr)
        return 1
    if args.data is None:
        from cifarkit.core.files import home
        args.data = home()
    log = Path(tempfile.gettempdir()) / "cifarkit-container-check.log"
    log.write_text("")
    with tempfile.TemporaryDirectory(prefix="cifarkit-container-") as work:
        conf = Path(work) / "containers.conf"
        conf.write_text(CONTAINERS_CONF)
        os.environ["CONTAINERS_CONF"] = str(conf)
        try:
            result = check(args, Path(work), log)
        except (CheckFailed, FileNotFoundError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    result["command"] = "python lab/container_check.py" + (" --no-cuda" if args.no_cuda else "")
    print("\n".join(summary_lines(result)))
    if args.json:
        from cifarkit.core.files import write_json
        write_json(args.json, result)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
