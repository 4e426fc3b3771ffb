import json

import pytest
import torch
import torch.nn.functional as F

from cifarkit import models
from cifarkit.cli import main
from cifarkit.core.errors import CifarkitError
from cifarkit.models import layers, winograd


def fastnet_params(w1, w2, w3, depth=2):
    """Whitening conv (2x2, 3->24, bias), three groups of `depth` bias-free 3x3 convs with BatchNorm, a 10-way head."""
    widths = [(24, w1), (w1, w2), (w2, w3)]
    convs = sum(9 * c_in * c_out + (depth - 1) * 9 * c_out * c_out for c_in, c_out in widths)
    norms = sum(depth * 2 * c_out for _, c_out in widths)
    return 3 * 24 * 4 + 24 + convs + norms + 10 * w3


# The write-ups state these counts; cifar10net's is exact, resnet18's is "about 11.2M".
EXPECTED_PARAMS = {"cifar10net": (815_018, 815_018), "simplecnn": (113_738, 113_738),
                   "resnet18": (11_150_000, 11_300_000),
                   "fastnet": (fastnet_params(64, 256, 256),) * 2,
                   "fastnet_wide": (fastnet_params(128, 384, 384),) * 2,
                   "fastnet_deep": (fastnet_params(128, 384, 512, depth=3),) * 2,
                   "fastnet_deep_half": (fastnet_params(64, 192, 256, depth=3),) * 2,
                   "fastnet_proxy": (fastnet_params(32, 64, 64),) * 2}


@pytest.mark.unit
@pytest.mark.parametrize("name", models.names())
def test_registry_model_counts_and_forward(name):
    model = models.create(name)
    low, high = EXPECTED_PARAMS[name]
    assert low <= models.count_params(model) <= high
    out = model.eval()(torch.randn(2, 3, 32, 32).contiguous(memory_format=torch.channels_last))
    assert out.shape == (2, 10)


@pytest.mark.unit
def test_a_residual_group_adds_its_pooled_input_back_after_its_third_convolution():
    from cifarkit.models.fastnet import ResidualConvGroup
    group = ResidualConvGroup(8, 16).eval()
    x = torch.randn(2, 8, 8, 8)
    pooled = group[3](group[2](group[1](group[0](x))))
    branch = group[8](group[7](group[6](group[5](group[4](pooled)))))
    assert torch.allclose(group(x), torch.nn.functional.gelu(pooled + branch))


@pytest.mark.unit
def test_resnet18_keeps_full_resolution_in_the_stem():
    model = models.create("resnet18")
    stem_convs = [m for m in model.stem if isinstance(m, torch.nn.Conv2d)]
    assert [c.kernel_size for c in stem_convs] == [(3, 3)] * 3 and all(c.stride == (1, 1) for c in stem_convs)
    assert not any(isinstance(m, torch.nn.MaxPool2d) for m in model.modules())


@pytest.mark.unit
def test_norm_momentum_replaces_each_models_own_in_every_batchnorm():
    def momenta(model):
        return {m.momentum for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert momenta(models.create("fastnet")) == {0.4} and momenta(models.create("resnet18")) == {0.1}
    assert momenta(models.create("fastnet", norm_momentum=0.4434)) == {0.4434}
    assert momenta(models.create("fastnet_deep", norm_momentum=0.3)) == {0.3}


@pytest.mark.unit
def test_unknown_model_lists_the_choices():
    with pytest.raises(CifarkitError, match="unknown model 'resnet50'; choose from cifar10net, fastnet, fastnet_deep, "
                                             "fastnet_deep_half, fastnet_proxy, fastnet_wide, resnet18, simplecnn"):
        models.create("resnet50")


@pytest.mark.unit
def test_models_command(capsys):
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    assert rows["cifar10net"]["params"] == 815_018
    # MACs of cifar10net counted by hand: six 3x3 convs at 32/16/8 px, then the two linear layers.
    convs = [(3, 32, 32), (32, 32, 32), (32, 64, 16), (64, 64, 16), (64, 128, 8), (128, 128, 8)]
    by_hand = sum(c_in * c_out * 9 * size * size for c_in, c_out, size in convs) + 2048 * 256 + 256 * 10
    assert rows["cifar10net"]["macs"] == by_hand
    assert main(["models"]) == 0
    assert "815,018" in capsys.readouterr().out


@pytest.mark.unit
@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("padding", [(1, 1, 1, 1), (1, 0, 1, 0)])
@pytest.mark.parametrize("slice_rows", [10_000, 21])
def test_matmul_weight_gradient_equals_the_convolutions(memory_format, padding, slice_rows):
    padded = F.pad(torch.randn(5, 6, 7, 3), padding).contiguous(memory_format=memory_format)
    weight = torch.randn(4, 6, 3, 3)
    out_h, out_w = padded.shape[2] - 2, padded.shape[3] - 2
    grad_output = torch.randn(5, 4, out_h, out_w).contiguous(memory_format=memory_format)
    expected = torch.ops.aten.convolution_backward(grad_output, padded, weight, None, [1, 1], [0, 0], [1, 1], False,
                                                   [0, 0], 1, [False, True, False])[1]
    # 21 rows: one image per slice, five slices.
    result = layers.weight_gradient_by_matmul(grad_output, padded, slice_rows=slice_rows)
    assert result.dtype == torch.float32
    torch.testing.assert_close(result, expected, rtol=1e-5, atol=1e-4)


@pytest.fixture(params=sorted(layers.KERNEL_PLANS))
def kernel_plan(request, monkeypatch):
    """Each CPU's plan, whatever CPU runs the test."""
    plan = layers.KERNEL_PLANS[request.param]
    monkeypatch.setattr(layers, "cpu_plan", lambda: plan)
    return plan


@pytest.mark.parametrize("model_name", ["fastnet", "fastnet_deep"])
def test_pooled_convolutions_skip_only_what_the_pool_drops(model_name, kernel_plan):
    # The first convolution of each group is followed by a 2x2 max-pool; in bf16 training its 7x7 one computes only
    # the 6x6 outputs the pool reads, and without AMX its 15x15 one the 14x14. The network's loss and gradients are
    # those of every output computed, as close to fp32's as bf16 gets when every output is computed (without AMX
    # the 7x7 one takes Winograd, which rounds elsewhere than oneDNN, so the bf16 runs are compared through fp32).
    torch.manual_seed(0)
    model = models.create(model_name).train()
    pooled = [m for m in model.modules() if isinstance(m, layers.Conv3x3) and m.pooled]
    assert len(pooled) == 3
    x = torch.randn(8, 3, 32, 32).contiguous(memory_format=torch.channels_last)  # bf16 is emulated on AVX2: slow
    results, shapes = [], []
    hooks = [conv.register_forward_hook(lambda module, args, out: shapes.append(out.shape[-1])) for conv in pooled]
    for crop, bf16 in ((True, True), (False, True), (False, False)):
        for conv in pooled:
            conv.pooled = crop
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = model(x).float().square().sum()
        loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    for hook in hooks:
        hook.remove()
    cropped_15 = 14 if kernel_plan.onednn_crop_max_width >= 15 else 15
    assert shapes[:6] == [31, cropped_15, 6, 31, 15, 7]
    (loss, grads), (full_loss, full_grads), (fp32_loss, fp32_grads) = results
    torch.testing.assert_close(loss, full_loss, rtol=1e-2, atol=0)

    def error(grad, exact):
        return ((grad - exact).norm() / exact.norm()).item()
    for grad, full, exact in zip(grads, full_grads, fp32_grads, strict=True):
        assert error(grad, exact) <= 1.25 * error(full, exact) + 1e-3


@pytest.mark.unit
@pytest.mark.parametrize("width", [3, 7, 15, 16])
@pytest.mark.parametrize("pooled", [False, True])
def test_conv3x3_trains_like_conv2d_under_bf16_autocast(width, pooled, kernel_plan):
    torch.manual_seed(0)
    conv = layers.Conv3x3(16, 32, pooled=pooled)
    # The paths the plan names for this layer; a cropped one computes only the outputs a following 2x2 pool reads.
    odd_pooled = pooled and width % 2 == 1
    bf16_winograd = odd_pooled and width <= kernel_plan.winograd_cropped_max_width
    matmul_path = width <= (kernel_plan.cropped_matmul_max_width if odd_pooled else kernel_plan.matmul_max_width)
    cropped = odd_pooled and (bf16_winograd or matmul_path or width <= kernel_plan.onednn_crop_max_width)
    kept = width - 1 if cropped else width
    reference = torch.nn.Conv2d(16, 32, 3, padding=1, bias=False)
    reference.load_state_dict(conv.state_dict())
    x = torch.randn(8, 16, width, width).contiguous(memory_format=torch.channels_last)
    results = []
    for module in (conv, reference):
        inputs = x.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if module is conv:
                path = conv.path(inputs)
            out = module(inputs)
        if module is reference:
            out = out[..., :kept, :kept]
        out.float().square().sum().backward()
        results.append((out, inputs.grad, module.weight.grad))
    (out, input_grad, weight_grad), (ref_out, ref_input_grad, ref_weight_grad) = results
    assert path == ("winograd-bf16" if bf16_winograd else "matmul-cropped" if matmul_path and cropped
                    else "matmul" if matmul_path else "onednn-cropped" if cropped else "plain")
    assert out.shape[-2:] == (kept, kept)
    assert out.dtype == ref_out.dtype == torch.bfloat16 and weight_grad.dtype == torch.float32
    if bf16_winograd:
        # Its transforms round too: within a few times the direct convolution's distance from exact arithmetic.
        exact_x, exact_weight = x.double().requires_grad_(), conv.weight.detach().double().requires_grad_()
        exact_out = F.conv2d(exact_x, exact_weight, padding=1)[..., :kept, :kept]
        exact_input_grad, exact_weight_grad = torch.autograd.grad(exact_out.square().sum(), (exact_x, exact_weight))
        for ours, direct, truth in ((out, ref_out, exact_out), (input_grad, ref_input_grad, exact_input_grad),
                                    (weight_grad, ref_weight_grad, exact_weight_grad)):
            distance = [((t.double() - truth).norm() / truth.norm()).item() for t in (ours, direct)]
            assert distance[0] <= 4 * distance[1], distance
    else:
        torch.testing.assert_close(out, ref_out)
        torch.testing.assert_close(input_grad, ref_input_grad)
        # Both gradients are sums of bf16 products, rounded to bf16: equal to within a few of its ulps.
        torch.testing.assert_close(weight_grad, ref_weight_grad, rtol=2e-2,
                                   atol=2e-2 * ref_weight_grad.abs().max().item())
    # fp32 training takes Winograd on the pooled layers it crops and on the unpooled 7x7 and 3x3 ones, and nothing
    # else; evaluation, tracing and export see the plain convolution.
    winograd_path = odd_pooled or (not pooled and width in (3, 7))
    assert conv.path(x.requires_grad_()) == ("winograd" if winograd_path else "plain")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert conv.eval().path(x) == "plain"
    assert conv.eval().path(x) == "plain"


@pytest.mark.unit
@pytest.mark.parametrize("memory_format", [torch.channels_last, torch.contiguous_format])
@pytest.mark.parametrize("width", [3, 7, 15, 16])
@pytest.mark.parametrize("tile_rows", [1536, 5])
@pytest.mark.parametrize("cropped_by_pool", [True, False])
@pytest.mark.parametrize("outputs_per_tile", [2, 4])
def test_winograd_convolution_equals_conv2d_on_its_outputs(memory_format, width, tile_rows, cropped_by_pool,
                                                           outputs_per_tile, monkeypatch):
    # Five tile rows: a slice of one image each, so the slices' sums and the overlapping tiles' gradients are tested.
    # Kept outputs that the block size does not divide are computed rounded up to whole blocks and cropped.
    monkeypatch.setattr(winograd, "TILE_ROWS", {outputs_per_tile: tile_rows})
    torch.manual_seed(0)
    kept = width - width % 2 if cropped_by_pool else width
    x = torch.randn(3, 5, width, width, dtype=torch.float64).contiguous(memory_format=memory_format)
    weight = torch.randn(7, 5, 3, 3, dtype=torch.float64)
    grad_output = torch.randn(3, 7, kept, kept, dtype=torch.float64)
    results = []
    for compute in (lambda x, w: winograd.WinogradConv3x3.apply(x, w, kept, kept, outputs_per_tile),
                    lambda x, w: F.conv2d(x, w, padding=1)[..., :kept, :kept]):
        inputs, filters = x.clone().requires_grad_(), weight.clone().requires_grad_()
        out = compute(inputs, filters)
        out.backward(grad_output)
        results.append((out, inputs.grad, filters.grad))
    for ours, reference in zip(*results, strict=True):
        assert ours.shape == reference.shape
        torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-10)


@pytest.mark.unit
@pytest.mark.parametrize("outputs_per_tile", [2, 4])
def test_winograd_skips_the_input_gradient_nobody_asked_for(outputs_per_tile):
    x = torch.randn(2, 4, 7, 7)
    weight = torch.randn(6, 4, 3, 3, requires_grad=True)
    winograd.WinogradConv3x3.apply(x, weight, 6, 6, outputs_per_tile).sum().backward()
    expected = torch.autograd.grad(F.conv2d(x, weight, padding=1)[..., :6, :6].sum(), weight)[0]
    assert x.grad is None
    torch.testing.assert_close(weight.grad, expected, rtol=1e-5, atol=1e-4)


@pytest.mark.unit
@pytest.mark.parametrize("outputs_per_tile", [2, 4])
def test_winograd_backward_reuses_the_forward_passes_tiles(outputs_per_tile, monkeypatch):
    # The backward pass reads the tiles that the forward pass transformed, slice by slice, instead of transforming
    # the input again: one transform per slice in all. Three slices of one image each, the last images' tiles too.
    monkeypatch.setattr(winograd, "TILE_ROWS", {outputs_per_tile: 1})
    transformed = []
    transform_tiles = winograd._transform_tiles
    monkeypatch.setattr(winograd, "_transform_tiles",
                        lambda *args: transformed.append(args[1].shape[0]) or transform_tiles(*args))
    x = torch.randn(3, 4, 7, 7, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(6, 4, 3, 3, dtype=torch.float64, requires_grad=True)
    out = winograd.WinogradConv3x3.apply(x, weight, 6, 6, outputs_per_tile)
    grad_output = torch.randn_like(out)
    out.backward(grad_output)
    assert transformed == [1, 1, 1]
    expected = torch.autograd.grad(F.conv2d(x, weight, padding=1)[..., :6, :6], (x, weight), grad_output)
    torch.testing.assert_close((x.grad, weight.grad), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.unit
@pytest.mark.parametrize("outputs_per_tile", sorted(winograd.TRANSFORMS))
def test_winograd_transforms_as_programs_equal_their_matrices(outputs_per_tile):
    # Each transform and its adjoint, run as the straight-line program with the butterflies taken out, equals the
    # matrix product, written to new tensors, into given ones and added to them; and F(4x4)'s take fewer passes.
    transform = winograd.TRANSFORMS[outputs_per_tile]
    torch.manual_seed(0)
    for matrix in (transform.input_rows, transform.output_rows):
        for rows in (matrix, tuple(zip(*matrix))):
            inputs = torch.randn(len(rows[0]), 3, 5, dtype=torch.float64)
            expected = torch.tensor(rows, dtype=torch.float64) @ inputs.view(len(rows[0]), -1)
            torch.testing.assert_close(torch.stack(winograd._apply(rows, list(inputs))).view(len(rows), -1), expected)
            written = torch.ones(len(rows), 3, 5, dtype=torch.float64)
            winograd._apply(rows, list(inputs), outs=list(written))
            torch.testing.assert_close(written.view(len(rows), -1), expected)
            winograd._apply(rows, list(inputs), outs=list(written), accumulate=True)
            torch.testing.assert_close(written.view(len(rows), -1), 2 * expected)
            # Operations: one per term, less one where a coefficient 1 lets two terms share an add.
            code = winograd.program(rows)
            plain = [tuple((c, k) for k, c in enumerate(row) if c) for row in rows]
            operations = [sum(len(terms) - (len(terms) > 1 and any(c == 1 for c, _ in terms)) for terms in program)
                          for program in (code.temporaries + code.outputs, plain)]
            assert operations[0] < operations[1] if outputs_per_tile == 4 else operations[0] <= operations[1]


@pytest.mark.unit
def test_fastnet_trains_in_fp32_as_without_winograd(monkeypatch):
    # In fp32 training fastnet's pooled 15x15 and 7x7 layers compute their 14x14 and 6x6 outputs by Winograd, and its
    # unpooled 7x7 and 3x3 layers their 8x8 and 4x4 ones, cropped; the others stay on oneDNN. The loss and every
    # gradient are those of the plain network.
    torch.manual_seed(0)
    model = models.create("fastnet").train()
    convs = [m for m in model.modules() if isinstance(m, layers.Conv3x3)]
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    paths, results = [], []
    hooks = [conv.register_forward_pre_hook(lambda module, args: paths.append(module.path(args[0]))) for conv in convs]
    for plain in (False, True):
        with monkeypatch.context() as patch:
            if plain:
                patch.setattr(layers, "WINOGRAD_MAX_WIDTH", 0)
                patch.setattr(layers, "WINOGRAD_UNPOOLED_WIDTHS", ())
            model.zero_grad()
            loss = model(x).square().sum()
            loss.backward()
        results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    for hook in hooks:
        hook.remove()
    assert paths == ["plain", "plain", "winograd", "winograd", "winograd", "winograd"] + ["plain"] * 6
    # F(4x4, 3x3) where its blocks need fewer products: 14x14 (16 tiles of 36 products against 49 of 16), 7x7 as
    # 8x8, 3x3 as 4x4; F(2x2, 3x3) at the 6x6 tie.
    assert [layers.winograd_tile(kept) for kept in (14, 7, 6, 3)] == [4, 4, 2, 4]
    (loss, grads), (plain_loss, plain_grads) = results
    torch.testing.assert_close(loss, plain_loss, rtol=1e-5, atol=0)
    for grad, plain in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(grad, plain, rtol=1e-4, atol=1e-4 * plain.abs().max().item())


@pytest.mark.unit
def test_each_cpu_gets_the_plan_measured_for_its_bf16_engine(monkeypatch):
    for features, plan in ((["avx2", "avx512", "avx512_bf16", "amx"], "amx"),
                           (["avx2", "avx512", "avx512_bf16"], "no_amx")):
        monkeypatch.setattr(layers, "cpu_features", lambda: features)
        layers.cpu_plan.cache_clear()
        assert layers.cpu_plan() is layers.KERNEL_PLANS[plan]
    layers.cpu_plan.cache_clear()


@pytest.mark.parametrize("bf16", [False, True])
def test_fastnet_training_step_compiles_as_one_graph(bf16):
    # `train.compile` on the CPU: Conv3x3's own paths (Winograd, the matmul weight gradient) would break the graph at
    # every layer, and Winograd's transforms failed dynamo's tracing; compiled, each layer is a plain convolution.
    # aot_eager traces forward and backward as inductor would, without building C++, so the test takes seconds.
    torch.manual_seed(0)
    model = models.create("fastnet").train()
    x = torch.randn(4, 3, 32, 32).contiguous(memory_format=torch.channels_last)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    grads = []
    for forward in (compiled, model):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = forward(x).float().square().sum()
        loss.backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    convs = [m for m in model.modules() if isinstance(m, layers.Conv3x3)]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        assert {conv.path(torch.zeros(1, conv.in_channels, 7, 7)) for conv in convs} != {"plain"}  # eager: not plain
    for compiled_grad, eager_grad in zip(*grads, strict=True):
        assert compiled_grad.isfinite().all()
        assert ((compiled_grad - eager_grad).norm() / eager_grad.norm()).item() < (5e-2 if bf16 else 1e-4)
