"""The README stays a newcomer's page and the docs hold the rest: the README's length, links that lead somewhere,
and every generated block in exactly one page, the one lab/render_readme.py rewrites."""
import json
import re

import pytest
import torch

from conftest import ROOT, load_script

pytestmark = pytest.mark.unit

render = load_script(ROOT / "lab" / "render_readme.py")
PAGES = render.pages()
README_MAX_LINES = 250  # issue 32: what it is, the quick start, one table, the commands, the links


def test_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_lead_to_files(page):
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    missing = [t for t in targets if "://" not in t and not (page.parent / t).exists()]
    assert missing == []


def test_every_block_is_in_exactly_one_page():
    texts = [page.read_text() for page in PAGES]
    counts = {name: sum(f"<!-- {name}:begin -->" in text for text in texts) for name in render.BLOCKS}
    assert counts == {name: 1 for name in render.BLOCKS}


def test_serving_goals_name_what_the_model_alone_allows():
    """One row per serving benchmark, with the least mean latency its model allows at 64 connections (Little's law)
    and the model's own gain from batching, both from the same file."""
    files = sorted((ROOT / "results").glob("serve-bench*.json"))
    rows = [line for line in render.serving_goals_block().splitlines() if "`results/" in line]
    assert len(rows) == len(files) > 0
    for row, path in zip(rows, files):
        alone = json.loads(path.read_text())["model_alone"]
        best = max(alone[f"batch_{b}_images_per_s"] for b in (1, 32, 64))
        assert path.name in row and f"| {64_000 / best:.0f} ms |" in row
        assert f"| {best / alone['batch_1_images_per_s']:.2f}x |" in row


def test_serving_defaults_are_compared_with_backends_of_the_same_processor(tmp_path, monkeypatch):
    """Zen 2 and Zen 3 are both of the AVX2 kind: a faster backend on one must not set the other's 'best here'."""
    def bench(name, cpu_model, backend, req_per_s):
        goals = {"req_per_s": req_per_s, "p99_ms": 200.0, "p99_met": False, "ratio": 1.5, "ratio_met": False}
        result = {"command": f"python lab/bench_serve.py --backend {backend}",
                  "environment": {"processor": "AMD EPYC", "cpu_model": cpu_model, "cpu_features": ["avx2"]},
                  "model_alone": {"batch_1_images_per_s": 100.0, "batch_32_images_per_s": 200.0,
                                  "batch_64_images_per_s": 150.0},
                  "servers": {"batched": {"served": {"backend": "onnxruntime"}}},
                  "summary": {"goals": {"concurrency_64": goals},
                              "goal_constants": {"concurrency": 64, "p99_ms": 100, "ratio": 2.5}}}
        (tmp_path / f"serve-bench-{name}.json").write_text(json.dumps(result))
    bench("a-defaults", "family 23 model 49", "auto", 300.0)
    bench("b-fp32", "family 23 model 49", "torch-fp32", 400.0)
    bench("c-other", "family 25 model 1", "torch-fp32", 600.0)
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    rows = [line for line in render.serving_goals_block().splitlines() if "`results/" in line]
    assert "family 23 model 49" in rows[0] and "| 0.75x |" in rows[0]
    assert "family 25 model 1" in rows[2]


def test_every_validation_sweep_is_shown_oldest_first_with_its_table():
    sweeps = sorted((json.loads(path.read_text())["measured"], path) for path in (ROOT / "results").glob(
        "validation-*.json"))
    block = render.validation_block()
    positions = [block.index(f"`results/{path.name}`") for _, path in sweeps]
    assert len(positions) > 0 and positions == sorted(positions)
    for _, path in sweeps:
        result = json.loads(path.read_text())
        assert all(line in block for line in result["table"]) and f"as at {result['written_at_commit']}," in block


def test_the_bf16_winograd_table_times_each_layer_as_training_takes_it(tmp_path, monkeypatch):
    measure = load_script(ROOT / "lab" / "measure_winograd.py")
    out = tmp_path / "winograd-layers-bf16-test.json"
    shipped = dict(measure.layers.KERNEL_PLANS)
    measure.main(["--model", "fastnet_proxy", "--batch-size", "2", "--tile-rows", "4", "--rounds", "1",
                  "--model-rounds", "2", "--precision", "bf16", "--json", str(out)])
    result = json.loads(out.read_text())
    layers = result["layers"]
    assert result["precision"] == "bf16" and [layer["winograd_tile"] for layer in layers] == [2] * 6
    model = measure.models.create("fastnet_proxy").train()
    expected = [conv.path(torch.zeros(1, conv.in_channels, width, width, dtype=torch.bfloat16, requires_grad=True))
                for conv, width in zip((m for m in model.modules() if isinstance(m, measure.layers.Conv3x3)),
                                       (31, 15, 15, 7, 7, 3), strict=True)]
    assert [layer["bf16_training_path"] for layer in layers] == expected
    assert set(layers[0]["median_s"]) == {"onednn", "as_trained"} | {
        f"winograd2_{rows}" for rows in (4, measure.winograd.TILE_ROWS[2])}
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    rows = [line for line in render.winograd_block().splitlines() if line.startswith("| ") and "->" in line]
    medians = layers[4]["median_s"]
    assert rows[4].endswith(f"| {1e3 * medians['as_trained']:,.0f} | "
                            + " | ".join(f"{1e3 * medians[f'winograd2_{r}']:,.0f}"
                                         for r in sorted({4, measure.winograd.TILE_ROWS[2]}))
                            + f" | {medians['onednn'] / medians['as_trained']:.2f}x |")
    assert "bf16 training takes" in render.winograd_block()
    whole = result["whole_model"]
    assert set(whole["samples_s"]) == {"onednn", "without_winograd", "as_trained"}
    assert whole["plans"]["without_winograd"]["KERNEL_PLANS"]["no_amx"]["winograd_cropped_max_width"] == 0
    assert measure.layers.KERNEL_PLANS == shipped  # the shipped plans are back in place after


def test_the_winograd_table_is_rendered_from_a_measurement(tmp_path, monkeypatch):
    measure = load_script(ROOT / "lab" / "measure_winograd.py")
    out = tmp_path / "winograd-layers-test.json"
    chosen_rows = dict(measure.winograd.TILE_ROWS)
    measure.main(["--model", "fastnet_proxy", "--batch-size", "2", "--tile-rows", "4", "--rounds", "1",
                  "--model-rounds", "2", "--json", str(out)])
    result = json.loads(out.read_text())
    layers = result["layers"]
    # fastnet_proxy's six 3x3 layers in forward order; the pooled 15 and 7 pixel ones and the unpooled 7 and 3 pixel
    # ones take Winograd in fp32 training, each with the block of fewest products.
    assert [(layer["width"], layer["pooled"], layer["fp32_training_path"]) for layer in layers] == [
        (31, True, "plain"), (15, False, "plain"), (15, True, "winograd"), (7, False, "winograd"),
        (7, True, "winograd"), (3, False, "winograd")]
    assert [layer["kept_outputs"] for layer in layers] == [30, 15, 14, 7, 6, 3]
    assert [layer["winograd_tile"] for layer in layers] == [4, 4, 4, 4, 2, 4]
    assert [layer["input_gradient"] for layer in layers] == [False] + [True] * 5
    # Every block size at the slice size asked for and at the one it ships with.
    assert set(layers[0]["median_s"]) == {"onednn"} | {f"winograd{m}_{rows}" for m in chosen_rows
                                                      for rows in (4, chosen_rows[m])}
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    rows = [line for line in render.winograd_block().splitlines() if line.startswith("| ") and "->" in line]
    assert len(rows) == 6
    onednn, chosen = (layers[2]["median_s"][name] for name in ("onednn", f"winograd4_{chosen_rows[4]}"))
    assert rows[2].startswith("| 32 -> 64 at 15x15, pooled (14x14 kept) (16x16 by F(4x4)) | yes | F(4x4, 3x3) |")
    assert rows[2].endswith(f"| {onednn / chosen:.2f}x |")
    assert rows[0].startswith("| 24 -> 32 at 31x31, pooled (30x30 kept) | no | oneDNN |")  # no block where none
    assert rows[0].endswith("| 1.00x |")
    # The whole model under each choice of layers, in turns; the choices shipped in layers.py are back in place after.
    whole = result["whole_model"]
    assert {plan: len(samples) for plan, samples in whole["samples_s"].items()} == {
        "onednn": 2, "f2_only": 2, "pooled_up_to_8": 2, "as_trained": 2}
    assert whole["plans"]["pooled_up_to_8"]["WINOGRAD_MAX_WIDTH"] == 8  # the pooled 15x15 layer back on oneDNN
    assert whole["plans"]["as_trained"]["WINOGRAD_UNPOOLED_WIDTHS"] == list(measure.layers.WINOGRAD_UNPOOLED_WIDTHS)
    assert measure.layers.WINOGRAD_MAX_WIDTH > 0 and measure.layers.WINOGRAD_UNPOOLED_WIDTHS
    assert measure.layers.WINOGRAD_MAX_TILE == 4 and measure.winograd.TILE_ROWS == chosen_rows
    trained = whole["median_s"]["as_trained"]
    assert f"as fp32 training takes them {1e3 * trained:,.0f} ms." in render.winograd_block()


def _speedrun_report(device: str, curve_points: int) -> dict:
    gpus = [{"name": "NVIDIA H200", "memory_gib": 139.8}] if device == "cuda" else []
    return {"recipe": "fast", "overrides": [f"train.device={device}"], "target": 0.94,
            "accuracy": {"n": 2, "mean": 0.9395, "std": 0.001, "ci95": [0.93, 0.95], "p_value_mean_above_target": 0.5},
            "wall_time_s": {"mean": 5.0, "max": 8.0, "min": 2.0},
            "environment": {"device": device, "gpus": gpus, "torch": "2.11.0+cu130", "processor": "AMD EPYC",
                            "cpu_features": ["avx2"]},
            "runs": [{"train_time_s": t, "run": {"precision": "fp16" if device == "cuda" else "fp32"},
                      "curve": [{"epoch": e} for e in range(curve_points)], "machine_speed": None}
                     for t in (6.04, 2.96)]}


def test_gpu_speed_runs_have_their_own_table(tmp_path, monkeypatch):
    """A speed run made on CUDA is no CPU kind's row: it goes to the GPU table, with its GPU, the torch that ran
    there, every run's training time and the command as the JSON tells it (--no-curve where no run has a curve)."""
    (tmp_path / "speedrun-fast-cuda.json").write_text(json.dumps(_speedrun_report("cuda", 1)))
    (tmp_path / "speedrun-fast-avx2.json").write_text(json.dumps(_speedrun_report("cpu", 8)))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    cpu_rows = [line for line in render.cpu_kind_block().splitlines() if "`results/" in line]
    gpu_rows = [line for line in render.gpu_block().splitlines() if "`results/" in line]
    assert len(cpu_rows) == 1 and "speedrun-fast-avx2.json" in cpu_rows[0]
    assert "`cifarkit speedrun --recipe fast --runs 2 --set train.device=cpu` " in cpu_rows[0]
    assert len(gpu_rows) == 1 and gpu_rows[0].startswith("| NVIDIA H200 | 2.11.0+cu130 | `fast` training, fp16, ")
    assert "training 6.0, 3.0 s by run" in gpu_rows[0]
    assert "`cifarkit speedrun --recipe fast --runs 2 --set train.device=cuda --no-curve`" in gpu_rows[0]
    assert "| 5.0 s / 8.0 s | NVIDIA H200 |" in render.speedrun_block()
    (tmp_path / "speedrun-fast-cuda.json").unlink()
    assert render.gpu_block().startswith("No GPU measured yet")


def test_a_figure_taken_under_isa_caps_names_them_beside_the_processor():
    # An AVX-512 CPU capped to AVX2 measures as an AVX2 kind, but it is not an AVX2 CPU: the rows say so.
    environment = {"processor": "AMD EPYC", "cpu_model": "family 25 model 17",
                   "isa_caps": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"}}
    assert render.processor_of(environment, "AMX") == ("AMD EPYC (family 25 model 17, capped by ONEDNN_MAX_CPU_ISA="
                                                       "AVX2, capped by ATEN_CPU_CAPABILITY=avx2, AMX)")
    assert render.processor_of({"processor": "AMD EPYC", "isa_caps": {}}) == "AMD EPYC"


@pytest.mark.parametrize("recorded, shown", [(1536, "batch 1,536, tcmalloc | 6.0 s per step (256 img/s)"),
                                             (None, "batch 2,000, tcmalloc | 6.0 s per step (333 img/s)")])
def test_an_ab_row_names_the_batch_its_runs_timed(tmp_path, monkeypatch, recorded, shown):
    """The A/B file's own batch; a file from before ab_profile recorded it timed `fast` at its old batch, 2,000."""
    runs = [{"step_s": step, "precision": "fp32", "allocator": "tcmalloc"} for step in (5.5, 6.5)]
    for run in runs:
        if recorded is not None:
            run["batch_size"] = recorded
    ab = {"cpu_kind": "avx2", "environment": {"processor": "AMD EPYC"}, "before": "aaaaaaa", "after": "bbbbbbb",
          "runs": {"before": runs, "after": runs}, "speedup_mean": 1.0, "speedup_ci95_half_width": 0.1,
          "command": "python lab/ab_profile.py --before aaaaaaa"}
    (tmp_path / "profile-ab-fast-avx2.json").write_text(json.dumps(ab))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    rows = [line for line in render.cpu_kind_block().splitlines() if "profile-ab-fast-avx2.json" in line]
    assert len(rows) == 1 and f"`fast` training step, fp32, {shown} at bbbbbbb" in rows[0]
