"""The GPU scripts of lab/ on a machine without one: the step check runs its steps on the CPU with nothing to check
and says so, refuses CUDA where there is none, and the reference runner's protocols and compile-mode switch do what
the references' own __main__ blocks do (the references themselves need CUDA: lab/device_check.sh runs them)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "tests" / "fixtures" / "cifar10-mini.safetensors"  # the committed real-data sample

spec = importlib.util.spec_from_file_location("reference_cuda", ROOT / "lab" / "reference_cuda.py")
reference_cuda = importlib.util.module_from_spec(spec)
spec.loader.exec_module(reference_cuda)


def step_check(tmp_path, *args):
    home = tmp_path / "home"
    home.mkdir(exist_ok=True)
    shutil.copy(FIXTURE, home / "cifar10.safetensors")
    env = {**os.environ, "CIFARKIT_HOME": str(home), "PYTHONPATH": str(ROOT / "src")}
    env.pop("CIFARKIT_DATA", None)
    return subprocess.run([sys.executable, str(ROOT / "lab" / "check_cuda_steps.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_the_step_check_runs_the_steps_on_a_cpu_and_checks_nothing(tmp_path):
    done = step_check(tmp_path, "--device", "cpu", "--recipe", "simplecnn", "--set", "data.subset=200",
                      "--set", "train.batch_size=50", "--steps", "2", "--json", str(tmp_path / "steps.json"))
    assert done.returncode == 0, done.stderr
    assert "check_cuda_steps: simplecnn, " in done.stdout and done.stdout.strip().endswith("not checked: no GPU")
    result = json.loads((tmp_path / "steps.json").read_text())
    assert result["checked"] is False and result["synchronizes"] is None and result["steps"] == 2
    assert result["compiled"] is False and result["warmup_s"] == 0.0


def test_the_step_check_refuses_cuda_without_a_gpu(tmp_path):
    done = step_check(tmp_path, "--steps", "2")
    assert done.returncode == 1
    assert done.stderr.strip().endswith("torch sees no CUDA device here; run it on a GPU, or give --device cpu")


def test_the_default_compile_mode_drops_every_mode():
    calls = []
    fake_torch = SimpleNamespace(compile=lambda model=None, **options: calls.append((model, options)))
    reference_cuda.without_compile_modes(fake_torch)
    fake_torch.compile("model", mode="max-autotune", fullgraph=True)
    fake_torch.compile(mode="max-autotune")  # the decorator form: @torch.compile(mode=...)
    assert calls == [("model", {"fullgraph": True}), (None, {})]


def test_airbench94_muon_is_timed_by_its_own_last_row():
    def main(run, model):
        module.print_training_details({"epoch": 1, "time_seconds": 1.0}, is_final_entry=False)
        module.print_training_details({"epoch": "eval", "time_seconds": 2.5}, is_final_entry=True)
        return 0.9401
    printed = []

    def own_printing(variables, is_final_entry):
        printed.append(variables["epoch"])
    module = SimpleNamespace(main=main, print_training_details=own_printing)
    assert reference_cuda.muon_run(module, None, 0) == {"test_acc": 0.9401, "train_time_s": 2.5}
    assert printed == [1, "eval"]  # its own printing still runs
    assert module.print_training_details is own_printing  # put back for the next run


def test_the_record_warm_up_is_not_idled_before():
    module = SimpleNamespace(main=lambda run, model: (0.935, 0.9402, 2.0))
    assert reference_cuda.record_run(module, None, "warmup") == {"test_acc": 0.9402, "test_acc_single_view": 0.935,
                                                                "train_time_s": 2.0}


def test_the_device_script_stops_at_once_without_a_gpu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(ROOT / "lab" / "device_check.sh"), str(tmp_path / "out")], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.strip().endswith("torch sees no CUDA device here; run this on a machine with an NVIDIA GPU")
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-written
