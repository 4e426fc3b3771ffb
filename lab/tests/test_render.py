"""The renderer of the README, the docs and results/README.md (lab/render_readme.py): the pages match a fresh render
of results/, the README shows current files only, a ratio never stands without its accuracy, and each history table
is rendered from what its command wrote."""
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from cifarkit.tools import result_tables, results

ROOT = Path(__file__).resolve().parents[2]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "lab" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


render = load("render_readme")
PAGES = render.pages()
RESULTS = ROOT / "results"


def test_the_pages_match_a_fresh_render_of_results():
    """CI's check: a block edited by hand, or a results file changed without rendering, fails here."""
    checked = subprocess.run([sys.executable, "lab/render_readme.py", "--check"], cwd=ROOT, capture_output=True,
                             text=True)
    assert checked.returncode == 0, checked.stderr


@pytest.mark.unit
def test_the_check_names_a_page_whose_block_was_edited(tmp_path, monkeypatch):
    page = tmp_path / "README.md"
    monkeypatch.setattr(render, "pages", lambda: [page])
    monkeypatch.setattr(render, "BLOCKS", {"models": lambda: "fresh"})
    page.write_text("<!-- models:begin -->\nfresh\n<!-- models:end -->\n")
    assert render.stale_pages() == []
    page.write_text("<!-- models:begin -->\nedited by hand\n<!-- models:end -->\n")
    monkeypatch.setattr(render, "ROOT", tmp_path)
    assert render.stale_pages() == ["README.md: differs first at 'fresh'"]


@pytest.mark.unit
def test_the_archive_holds_exactly_the_files_it_gives_reasons_for():
    archive = ROOT / "results" / "archive"
    reasons = yaml.safe_load((archive / "reasons.yaml").read_text())
    assert sorted(reasons) == sorted(p.name for p in archive.iterdir() if p.name != "reasons.yaml")
    assert all(isinstance(reason, str) and len(reason) > 20 for reason in reasons.values())
    assert not set(reasons) & {p.name for p in (ROOT / "results").iterdir()}  # moved, not copied


@pytest.mark.unit
def test_the_index_lists_every_results_file_with_its_commit_and_day():
    index = (ROOT / "results" / "README.md").read_text()
    files = [p for p in results.result_files(RESULTS, "*")
             if p.suffix in (".json", ".png") and p.name != "provenance.json"]
    for path in files:
        row = next(line for line in index.splitlines() if line.startswith(f"| [{results.rel(RESULTS, path)[8:]}]("))
        commit, day = row.split(" | ")[-3:-1]
        assert re.fullmatch(r"(added in )?[0-9a-f]{7}( with .*)?", commit), row
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", day), row
        assert ("| current" in row) == (path.parent.name == "results") != ("| superseded: " in row)


@pytest.mark.unit
def test_the_readme_shows_at_most_two_rows_per_device_kind_and_no_commit():
    rows = [line for line in results.expect_table(RESULTS).splitlines()[2:]]
    devices = [row.split(" | ")[0].lstrip("| ").split(":")[0] for row in rows]
    assert rows and all(devices.count(device) <= 2 for device in devices)
    assert not any(re.search(r"\b[0-9a-f]{7}\b", row.split(" | ")[2]) for row in rows)  # no commit in what you get
    for row in rows:  # every ratio at equal accuracy, or with its accuracy difference and a verdict in words
        if " as fast as " in row:
            assert "at equal accuracy (95% interval" in row or (
                "points of accuracy (95% interval" in row and "equal accuracy" in row)


@pytest.mark.unit
def test_every_block_is_in_exactly_one_page():
    texts = [page.read_text() for page in PAGES]
    counts = {name: sum(f"<!-- {name}:begin -->" in text for text in texts) for name in render.BLOCKS}
    assert counts == {name: 1 for name in render.BLOCKS}


@pytest.mark.unit
def test_serving_goals_name_what_the_model_alone_allows():
    """One row per serving benchmark, with the least mean latency its model allows at 64 connections (Little's law)
    and the model's own gain from batching, both from the same file."""
    files = results.result_files(RESULTS, "serve-bench*.json")
    rows = [line for line in result_tables.serving_goals_table(RESULTS).splitlines() if "`results/" in line]
    assert len(rows) == len(files) > 0
    for row, path in zip(rows, files):
        alone = json.loads(path.read_text())["model_alone"]
        best = max(alone[f"batch_{b}_images_per_s"] for b in (1, 32, 64))
        assert path.name in row and f"| {64_000 / best:.0f} ms |" in row
        assert f"| {best / alone['batch_1_images_per_s']:.2f}x |" in row


@pytest.mark.unit
def test_every_validation_sweep_is_shown_oldest_first_with_its_table():
    sweeps = sorted((json.loads(path.read_text())["measured"], path) for path in (ROOT / "results").glob(
        "validation-*.json"))
    block = result_tables.validation_tables(RESULTS)
    positions = [block.index(f"`results/{path.name}`") for _, path in sweeps]
    assert len(positions) > 0 and positions == sorted(positions)
    for _, path in sweeps:
        result = json.loads(path.read_text())
        assert all(line in block for line in result["table"]) and f"as at {result['written_at_commit']}," in block


def test_the_bf16_winograd_table_times_each_layer_as_training_takes_it(tmp_path):
    measure = load("measure_winograd")
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
    rows = [line for line in result_tables.winograd_tables(tmp_path).splitlines()
            if line.startswith("| ") and "->" in line]
    medians = layers[4]["median_s"]
    assert rows[4].endswith(f"| {1e3 * medians['as_trained']:,.0f} | "
                            + " | ".join(f"{1e3 * medians[f'winograd2_{r}']:,.0f}"
                                         for r in sorted({4, measure.winograd.TILE_ROWS[2]}))
                            + f" | {medians['onednn'] / medians['as_trained']:.2f}x |")
    assert "bf16 training takes" in result_tables.winograd_tables(tmp_path)
    whole = result["whole_model"]
    assert set(whole["samples_s"]) == {"onednn", "without_winograd", "as_trained"}
    assert whole["plans"]["without_winograd"]["KERNEL_PLANS"]["no_amx"]["winograd_cropped_max_width"] == 0
    assert measure.layers.KERNEL_PLANS == shipped  # the shipped plans are back in place after


def test_the_winograd_table_is_rendered_from_a_measurement(tmp_path):
    measure = load("measure_winograd")
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
    rows = [line for line in result_tables.winograd_tables(tmp_path).splitlines()
            if line.startswith("| ") and "->" in line]
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
    assert f"as fp32 training takes them {1e3 * trained:,.0f} ms." in result_tables.winograd_tables(tmp_path)




@pytest.mark.unit
def test_the_container_block_shows_the_cuda_images_refusal_its_user_and_jupyterlab(tmp_path, monkeypatch):
    """lab/container_check.py's record of the CUDA image, as its summary and the page read it; a record from before
    those checks says so."""
    assert "This record predates the CUDA image's entrypoint" in render.containers_block()
    check = load("container_check")
    record = json.loads((RESULTS / "container-check.json").read_text())
    refusal = ("cifarkit: error: this container sees no GPU; start it with --gpus all (the host needs the NVIDIA "
               "Container Toolkit), or with -e CIFARKIT_ALLOW_CPU=1 to run on the CPU on purpose")
    uid = int(check.HOST_USER.split(":")[0])
    record["cuda"]["training"].update(refused_without_gpu=refusal, user=check.HOST_USER, files_uid=uid)
    record["cuda"]["jupyter"] = {"command": " ".join(check.JUPYTER), "user": check.HOST_USER, "answered_seconds": 6.0,
                                 "notebook": "notebooks/quickstart.ipynb", "kernels": ["python3"]}
    (tmp_path / "container-check.json").write_text(json.dumps(record))
    monkeypatch.setattr(render, "RESULTS", tmp_path)
    block = render.containers_block()
    assert f"without a GPU it stops: `{refusal}`; with `CIFARKIT_ALLOW_CPU=1`, as uid {check.HOST_USER}" in block
    assert f"its files the uid's ({uid}); `jupyter lab --ip 0.0.0.0` as that uid answered in 6 s with " \
           "notebooks/quickstart.ipynb and the kernels python3; the healthcheck fails" in block
    assert "predates" not in block
    summary = "\n".join(check.summary_lines(record))
    assert f"without a GPU: {refusal}" in summary and "notebooks/quickstart.ipynb, kernels python3" in summary
