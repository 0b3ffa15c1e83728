"""The quantized Linear layer (numerics/quantized.py) and which layers get which format
(numerics/layers.py): each GEMM against the same product written out by hand with fake_quantize,
the recipe switches, the rules, and the CLI as a user runs it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from torch import nn

from halfprec.config import resolve_device, validate
from halfprec.config.schema import QuantRule as Rule
from halfprec.config.typed import typed
from halfprec.errors import ConfigError
from halfprec.numerics import quantized
from halfprec.numerics.converters.emulated import swap_emulated
from halfprec.numerics.formats import FORMATS, quantize
from halfprec.numerics.formats import fake_quantize as fq
from halfprec.numerics.formats.hadamard import random_hadamard, rotate
from halfprec.numerics.layers import plan_layers, shadowed_rules
from halfprec.numerics.quantized import QuantizedLinear, Recipe, keep_eager
from halfprec.numerics.settings import HIGH
from halfprec.training.build import build
from halfprec.training.run import run

from helpers import CONF, compose_cfg

GPT = ["task=lm", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=4"]


@pytest.fixture(autouse=True)
def fp32_gemms(monkeypatch):
    """The products written out here are fp32 GEMMs; so are the layer's (on a CPU with bf16 units it
    computes them with oneDNN's bf16 math, the same products summed in another order:
    test_a_cpu_with_bf16_units_multiplies_the_exact_operands_in_bf16)."""
    monkeypatch.setattr(quantized, "cpu_bf16", lambda: False)


def sq(t: torch.Tensor, name: str, axis: int, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """t's values in `name` with the scale the hardware applies to a GEMM's output split off
    (NVFP4's tensor scale, fp8's per tensor or per row), and that scale (1 where there is none)."""
    q = quantize(t, name, axis, split=True, **kwargs)
    return q.values, torch.ones(()) if q.factor is None else q.factor


def layer_and_grads(fmt: str, recipe: Recipe, tokens: int = 12, seed: int = 0):
    """A 32 -> 48 QuantizedLinear with a bias, run forward and backward on (2, tokens/2, 32) inputs."""
    torch.manual_seed(seed)
    linear = nn.Linear(32, 48)
    layer = QuantizedLinear.from_linear(linear, fmt, recipe, seed=7)
    x = torch.randn(2, tokens // 2, 32, requires_grad=True)
    y = layer(x)
    dy = torch.randn_like(y)
    y.backward(dy)
    return layer, x.detach().reshape(-1, 32), linear.weight.detach(), dy.reshape(-1, 48), y.detach(), x.grad


@pytest.mark.parametrize(
    "fmt, recipe",
    [
        ("mxfp4", Recipe()),
        ("mxfp8", Recipe(scale_rule="rceil")),
        ("nvfp4", Recipe(weight_2d=True)),
        ("fp8_e4m3", Recipe(grad_format="fp8_e5m2")),
        ("fp8_block", Recipe(weight_2d=True)),
    ],
)
def test_each_gemm_quantizes_its_operands_along_the_dimension_it_contracts(fmt, recipe):
    """Each GEMM as the hardware computes it: the operands' values multiplied, then the per-tensor or
    per-row scales applied to the fp32 output."""
    layer, x, w, dy, y, dx = layer_and_grads(fmt, recipe)
    g = recipe.grad_format or fmt
    rule = {"scale_rule": recipe.scale_rule} if fmt.startswith("mx") else {}
    tile = recipe.weight_2d
    # y = x W^T: x and W blocked along `in`; dx = dy W: dy and W along `out`; dW = dy^T x: along the tokens
    (vx, fx), (vw, fw) = sq(x, fmt, -1, **rule), sq(w, fmt, -1, tile=tile, **rule)
    expected_y = (vx @ vw.T) * (fx * fw.t()) + layer.bias.detach()
    (vdy, fdy), (vw0, fw0) = sq(dy, g, -1, **rule), sq(w, fmt, 0, tile=tile, **rule)
    expected_dx = (vdy @ vw0) * (fdy * fw0)
    (vdy0, fdy0), (vx0, fx0) = sq(dy, g, 0, **rule), sq(x, fmt, 0, **rule)
    expected_dw = (vdy0.T @ vx0) * (fdy0.t() * fx0)
    assert torch.equal(y.reshape(-1, 48), expected_y)
    assert torch.equal(dx.reshape(-1, 32), expected_dx)
    assert torch.equal(layer.weight.grad, expected_dw)
    assert torch.equal(layer.bias.grad, dy.sum(0))  # a sum, no GEMM: not quantized
    # the product of the dequantized values: the same where no scale is split off (MX, 1x128 blocks);
    # else a rounding per value apart (element x fp32 scale rounded before the GEMM)
    dequantized = fq(x, fmt, -1, **rule) @ fq(w, fmt, -1, tile=tile, **rule).T + layer.bias.detach()
    if FORMATS[fmt].factor is None:
        assert torch.equal(y.reshape(-1, 48), dequantized)
    else:
        torch.testing.assert_close(y.reshape(-1, 48), dequantized, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("high", ["forward", "dgrad", "wgrad"])
def test_a_high_gemm_multiplies_the_operands_as_they_are_the_others_as_the_format_does(high):
    """recipe.<gemm>=high: that GEMM multiplies its operands unquantized (here fp32: no autocast),
    the layer's other two GEMMs compute exactly as in a layer with every GEMM quantized."""
    fmt, recipe = "nvfp4", Recipe(weight_2d=True)
    layer, x, w, dy, y, dx = layer_and_grads(fmt, replace(recipe, **{high: "high"}))
    ref, _, _, _, y_ref, dx_ref = layer_and_grads(fmt, recipe)
    plain = {"forward": x @ w.T + layer.bias.detach(), "dgrad": dy @ w, "wgrad": dy.T @ x}
    got = {"forward": y.reshape(-1, 48), "dgrad": dx.reshape(-1, 32), "wgrad": layer.weight.grad}
    quantized_ = {"forward": y_ref.reshape(-1, 48), "dgrad": dx_ref.reshape(-1, 32), "wgrad": ref.weight.grad}
    for gemm in got:
        assert torch.equal(got[gemm], plain[gemm] if gemm == high else quantized_[gemm]), gemm
    assert quantized.gemm_label(layer.gemms) == "-".join("high" if g == high else fmt for g in got)


def test_a_gemm_in_another_format_takes_both_operands_in_it_and_grad_format_stays_with_the_layers():
    """fp8_e4m3 layers with e5m2 gradients and recipe.dgrad=mxfp8: the input-gradient GEMM takes dy
    and W in mxfp8; the weight-gradient GEMM keeps the layer's format, its dy in e5m2."""
    recipe = Recipe(grad_format="fp8_e5m2", dgrad="mxfp8")
    layer, x, w, dy, y, dx = layer_and_grads("fp8_e4m3", recipe)
    assert torch.equal(dx.reshape(-1, 32), fq(dy, "mxfp8", -1) @ fq(w, "mxfp8", 0))
    (vdy0, fdy0), (vx0, fx0) = sq(dy, "fp8_e5m2", 0), sq(x, "fp8_e4m3", 0)
    assert torch.equal(layer.weight.grad, (vdy0.T @ vx0) * (fdy0.t() * fx0))
    assert quantized.gemm_label(layer.gemms) == "fp8_e4m3-mxfp8-fp8_e4m3"


def test_a_high_forward_under_bf16_autocast_multiplies_bf16_operands_with_fp32_sums():
    """As an unquantized layer's GEMM in bf16 autocast: operands rounded to bf16, products summed in
    fp32, the output rounded to bf16."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 48, bias=False)
    layer = QuantizedLinear.from_linear(linear, "mxfp4", Recipe(forward="high"), seed=7)
    x = torch.randn(6, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    expected = (x.bfloat16().float() @ linear.weight.detach().bfloat16().float().T).bfloat16()
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected)


def test_statistics_are_kept_where_each_operand_is_first_quantized():
    """With the forward high, the weight's statistics come from the input-gradient GEMM and the
    input's from the weight-gradient GEMM; an operand no GEMM quantizes has none."""
    torch.manual_seed(0)
    for recipe, kept in [(Recipe(forward="high"), {"input", "weight", "grad_output"}),
                         (Recipe(forward="high", dgrad="high"), {"input", "grad_output"}),
                         (Recipe(dgrad="high", wgrad="high"), {"input", "weight"})]:  # fmt: skip
        layer = QuantizedLinear.from_linear(nn.Linear(32, 48), "mxfp4", recipe, seed=7)
        layer.stats = {}
        x = torch.randn(6, 32, requires_grad=True)
        layer(x).square().sum().backward()
        assert set(layer.stats) & set(quantized.OPERANDS) == kept, recipe
        noise = {"wgrad_exact", "wgrad_noise"}  # the gradient-to-noise ratio's sums, where dW is quantized
        assert (noise <= set(layer.stats)) == (recipe.wgrad != "high"), recipe


def chunked(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """a @ b for 1x128 scales along the contraction, written out: chunk c's product times a's scales
    of chunk c (one per row) and b's (one per column), the chunks summed in fp32."""
    (av, af), (bv, bf) = a, b
    parts = [(av[:, c : c + 128] @ bv[c : c + 128]) * (af[:, i : i + 1] * bf[i : i + 1]) for i, c in
             enumerate(range(0, av.shape[1], 128))]  # fmt: skip
    return torch.stack(parts).sum(0)


def test_1x128_blocks_scale_each_128_long_chunk_of_the_contraction():
    """fp8_block as DeepSeek-V3 computes it (each chunk's partial product promoted to fp32 with its
    scales): 300 inputs, 260 tokens and 40 outputs are 3, 3 and 1 chunks, the last ones padded;
    the weight in 128x128 tiles."""
    torch.manual_seed(0)
    linear = nn.Linear(300, 40, bias=False)
    layer = QuantizedLinear.from_linear(linear, "fp8_block", Recipe(weight_2d=True), seed=7)
    leaf = (torch.randn(260, 300) * torch.logspace(-2, 2, 300)).requires_grad_(True)
    y = layer(leaf)
    dy = torch.randn_like(y) * torch.logspace(-2, 2, 260)[:, None]
    y.backward(dy)
    w, x, y = linear.weight.detach(), leaf.detach(), y.detach()
    wt, w0 = sq(w, "fp8_block", -1, tile=True), sq(w, "fp8_block", 0, tile=True)
    assert torch.equal(y, chunked(sq(x, "fp8_block", -1), (wt[0].T, wt[1].T)))
    assert torch.equal(leaf.grad, chunked(sq(dy, "fp8_block", -1), w0))
    dy0 = sq(dy, "fp8_block", 0)
    assert torch.equal(linear.weight.grad, chunked((dy0[0].T, dy0[1].T), sq(x, "fp8_block", 0)))
    assert not torch.equal(y, fq(x, "fp8_block") @ fq(w, "fp8_block", tile=True).T)  # a rounding per value apart


def test_a_cpu_with_bf16_units_multiplies_the_exact_operands_in_bf16(monkeypatch):
    """oneDNN's bf16 math converts fp32 operands to bf16: lossless for the formats' values (its sums
    then as close to the exact product as fp32's), lossy for other numbers: it is on inside the
    layer's GEMMs alone. Skipped where the mode does not take effect (no AMX), where the GEMMs stay fp32."""
    if not quantized.cpu_bf16():
        pytest.skip("oneDNN's bf16 math mode does not take effect on this CPU (no AMX): its quantized GEMMs are fp32")
    monkeypatch.setattr(quantized, "cpu_bf16", lambda: True)
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(256, 512, generator=g), torch.randn(512, 256, generator=g)
    a, b = fq(raw[0], "mxfp8"), fq(raw[1], "mxfp8", axis=0)
    exact = a.double() @ b.double()
    bf16, fp32 = quantized.product(a, b, True), quantized.product(a, b, False)
    assert (bf16.double() - exact).abs().max() <= 4 * (fp32.double() - exact).abs().max() + 1e-5
    lossy = (quantized.product(*raw, True).double() - raw[0].double() @ raw[1].double()).abs().max()
    assert lossy > 100 * (fp32.double() - exact).abs().max()  # the mode was on: raw fp32 operands were rounded
    assert torch.equal(raw[0] @ raw[1], quantized.product(*raw, False))  # and off again outside


def test_the_hadamard_transform_rotates_both_weight_gradient_operands_alone():
    """dW from the rotated operands (12 tokens padded to 16), the forward and dx untouched; unquantized,
    the rotation would leave dW as it is."""
    plain = layer_and_grads("nvfp4", Recipe())
    layer, x, w, dy, y, dx = layer_and_grads("nvfp4", Recipe(hadamard=True))
    assert torch.equal(y, plain[4]) and torch.equal(dx, plain[5])
    h = random_hadamard(16, torch.Generator().manual_seed(7))
    pad = torch.zeros(4, 48), torch.zeros(4, 32)
    a, b = rotate(torch.cat([dy, pad[0]]), h, 0), rotate(torch.cat([x, pad[1]]), h, 0)
    (va, fa), (vb, fb) = sq(a, "nvfp4", 0), sq(b, "nvfp4", 0)
    assert torch.equal(layer.weight.grad, (va.T @ vb) * (fa * fb))
    assert torch.allclose(a.T @ b, dy.T @ x, atol=1e-5)  # orthogonal: the exact GEMM is unchanged
    assert not torch.equal(layer.weight.grad, plain[0].weight.grad)


def test_stochastic_rounding_touches_only_the_gradient_and_is_unbiased_and_seeded():
    """rceil: OCP's floor scale lets a block's largest values saturate, a bias no rounding undoes."""
    near = layer_and_grads("mxfp4", Recipe(scale_rule="rceil"))
    runs = [layer_and_grads("mxfp4", Recipe(stochastic_grads=True, scale_rule="rceil")) for _ in range(2)]
    assert torch.equal(runs[0][4], near[4])  # the forward rounds to nearest
    assert torch.equal(runs[0][5], runs[1][5])  # same seed, same backward pass: same draws
    assert not torch.equal(runs[0][5], near[5])
    # E[q(dy)] = dy, and dx is linear in it: the mean of many backward passes is dy q(W along out)
    layer, x, w, dy, _, _ = runs[0]
    draws = []
    for _ in range(400):
        xi = x.clone().requires_grad_(True)
        layer(xi).backward(dy)
        draws.append(xi.grad)
    draws_t = torch.stack(draws)
    exact = dy @ fq(w, "mxfp4", 0, scale_rule="rceil")
    sigma = draws_t.std(0) / len(draws) ** 0.5
    assert ((draws_t.mean(0) - exact).abs() <= 3 * sigma).float().mean() > 0.97  # 99.7% expected
    assert layer.backward_passes == 401


def test_stochastic_rounding_resumes_from_the_state_dict():
    """A layer rebuilt from a state dict draws what the first would have drawn next."""
    layer = layer_and_grads("nvfp4", Recipe(stochastic_grads=True))[0]
    again = QuantizedLinear(32, 48, True, "nvfp4", Recipe(stochastic_grads=True), seed=7)
    again.load_state_dict(layer.state_dict())
    assert again.backward_passes == layer.backward_passes == 1
    x, dy = torch.randn(6, 32), torch.randn(6, 48)
    grads = []
    for m in (layer, again):
        m.weight.grad = None
        m(x).backward(dy)
        grads.append(m.weight.grad)
    assert torch.equal(*grads)


def test_under_autocast_the_product_is_fp32_and_the_output_the_autocast_dtype():
    layer = QuantizedLinear.from_linear(nn.Linear(32, 16), "mxfp8", Recipe(), seed=0)
    x = torch.randn(4, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    expected = fq(x.detach(), "mxfp8") @ fq(layer.weight.detach(), "mxfp8").T + layer.bias.detach()
    assert y.dtype == torch.bfloat16 and torch.equal(y, expected.bfloat16())
    y.float().sum().backward()
    assert x.grad is not None and x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


def gpt():
    return build(compose_cfg(*GPT)).model


def test_rules_first_match_wins_then_the_high_blocks_then_the_head():
    model = gpt()
    rules = [Rule("blocks.0.mlp.*", "mxfp8"), Rule("*.mlp.fc", HIGH)]
    plan = plan_layers(model, "nvfp4", rules, high_last=1)
    assert plan == {
        "blocks.0.attn.qkv": "nvfp4", "blocks.0.attn.proj": "nvfp4", "blocks.0.mlp.fc": "mxfp8",
        "blocks.0.mlp.proj": "mxfp8", "blocks.1.attn.qkv": HIGH, "blocks.1.attn.proj": HIGH,
        "blocks.1.mlp.fc": HIGH, "blocks.1.mlp.proj": HIGH, "lm_head": HIGH,
    }  # fmt: skip
    assert plan_layers(model, "mxfp4", [Rule("lm_head", "mxfp4")], high_first=1)["lm_head"] == "mxfp4"
    assert set(plan_layers(model, "mxfp4", [], high_first=1).values()) == {HIGH, "mxfp4"}


def test_a_rule_that_matches_nothing_and_high_blocks_without_blocks_are_config_errors():
    with pytest.raises(ConfigError, match=r"precision.rules\[1\].match=blocks.9.\*: matches no Linear layer"):
        plan_layers(gpt(), "nvfp4", [Rule("lm_head", HIGH), Rule("blocks.9.*", HIGH)])
    mlp = build(compose_cfg()).model
    with pytest.raises(ConfigError, match="precision.high_last=1: Sequential names no transformer blocks"):
        plan_layers(mlp, "nvfp4", [], high_last=1)


def test_a_rule_that_earlier_rules_take_every_layer_of_is_an_error_or_a_warning():
    """First match wins: a later rule for layers an earlier one takes would silently not happen (an
    error where it asks for another format; a warning where it repeats the earlier one's)."""
    model = gpt()
    with pytest.raises(ConfigError) as info:
        shadowed_rules(model, [Rule("blocks.0.*", HIGH), Rule("blocks.0.attn.qkv", "mxfp8")])
    assert str(info.value) == (
        "precision.rules[1].match=blocks.0.attn.qkv: every layer it matches is taken by precision.rules[0] (match "
        "blocks.0.*, format high) first (the first rule that matches a layer decides it): move it above, or narrow "
        "the earlier glob"
    )
    repeated = [Rule("*.attn.*", "mxfp8"), Rule("blocks.1.attn.qkv", "mxfp8")]
    assert shadowed_rules(model, repeated) == [
        "warning: precision.rules[1].match=blocks.1.attn.qkv changes nothing: precision.rules[0] (match *.attn.*, "
        "format mxfp8) gives its layers mxfp8 first; drop it"
    ]
    assert shadowed_rules(model, [Rule("blocks.0.attn.qkv", HIGH), Rule("blocks.0.*", "mxfp8")]) == []
    c = build(compose_cfg(*GPT, "precision=mxfp4", "precision.rules=[{match: '*.attn.*', format: high}, "
                          "{match: blocks.1.attn.qkv, format: high}]"))  # fmt: skip
    assert c.stepper.policy.notes[0].startswith("warning: precision.rules[1].match=blocks.1.attn.qkv changes nothing")
    with pytest.raises(ConfigError, match=r"precision.rules\[1\].match=blocks.1.attn.qkv: every layer it matches"):
        build(compose_cfg(*GPT, "precision=mxfp4", "precision.rules=[{match: '*.attn.*', format: high}, "
                          "{match: blocks.1.attn.qkv, format: mxfp8}]"))  # fmt: skip


def test_the_swap_keeps_tied_weights_tied_and_the_output_head_of_an_mlp_high():
    model = gpt()
    swap_emulated(model, plan_layers(model, "mxfp4", [Rule("lm_head", "mxfp4")]), Recipe(), seed=0, rank=0)
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.weight is model.wte.weight
    mlp = build(compose_cfg()).model
    plan = plan_layers(mlp, "mxfp4", [])
    assert list(plan.values()) == ["mxfp4", "mxfp4", HIGH]  # the classifier is the MLP's last Linear


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["precision.format=mxfp3"], "precision.format=mxfp3: no such number format; they are fp8_e4m3,"),
        (["precision=mxfp4", "precision.recipe=nvfp4"], "precision.recipe=nvfp4: a mapping of grad_format,"),
        (["precision=fp8", "precision.format=mxfp8"], "torchao has no training kernel for format=mxfp8"),
        (["precision=bf16", "precision.high_last=1"], "precision.high_last=1: keeps blocks high while the others"),
        (
            ["precision=bf16", "precision.recipe.hadamard=true"],
            "precision.recipe.hadamard=true: applies to precision.format.s layers; no layer is",
        ),
        (["precision=mxfp4", "precision.rules=[{match: lm_head, format: mxfp9}]"], r"precision.rules\[0\].format"),
        (["precision=mxfp4", "precision.rules=[{match: lm_head}]"], r"precision.rules\[0\]=.*a rule is \{match"),
        (
            ["precision=mxfp4", "precision.recipe.scale_rule=up"],
            "precision.recipe.scale_rule=up: must be floor or rceil",
        ),
        (["precision=mxfp4", "precision.recipe.wgrad=fp16"], r"recipe.wgrad=fp16: null \(the layer's format\), high,"),
        (["precision=bf16", "precision.recipe.wgrad=high"], "recipe.wgrad=high: applies to precision.format.s layers"),
        (["precision=fp8", "precision.recipe.wgrad=high"], "float8 kernel has no precision.recipe.wgrad"),
        (
            ["precision=mxfp4", *(f"precision.recipe.{g}=high" for g in ("forward", "dgrad", "wgrad"))],
            r"precision.recipe.forward/dgrad/wgrad=high: keeps all three GEMMs of every layer high, so nothing is "
            r"quantized: set one of them to null",
        ),
        (
            ["precision=mxfp4", "precision.schedule=[{from_step: 5, gemms: [fwd], format: high}]"],
            r"precision.schedule\[0\].gemms=\['fwd'\]: must be a non-empty list of forward, dgrad or wgrad",
        ),
    ],
)
def test_format_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(*GPT, *overrides))


def test_a_precision_error_answers_before_torch_is_imported():
    """config/rules.py's checks spell `high` with numerics/settings.py, which imports no torch."""
    code = (
        "import sys\n"
        "from hydra import compose, initialize_config_dir\n"
        "from halfprec.config import validate\n"
        "from halfprec.errors import ConfigError\n"
        f"with initialize_config_dir({str(CONF)!r}, version_base='1.3'):\n"
        "    cfg = compose('train', overrides=['logger=none', 'precision=bf16', 'precision.high_last=1'])\n"
        "try:\n"
        "    validate(cfg)\n"
        "except ConfigError as err:\n"
        "    print(err, 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.startswith("precision.high_last=1: keeps blocks high") and out.split()[-1] == "False", out


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["precision=mxfp4", "precision.recipe.weight_2d=true"],
            r"weight_2d=true: is for formats with square blocks .* no layer computes in one \(mxfp4\)",
        ),
        (
            ["precision=nvfp4", "precision.recipe.scale_rule=rceil"],
            r"scale_rule=rceil: is for formats with E8M0 scales .* \(nvfp4\): set precision.recipe.scale_rule=floor",
        ),
        (
            ["precision=mxfp4", "precision.recipe.scale_rule=rceil"]
            + [f"precision.recipe.{g}={f}" for g, f in (("forward", "nvfp4"), ("dgrad", "nvfp4"), ("wgrad", "high"))],
            r"scale_rule=rceil: is for formats with E8M0 scales",
        ),
        (["precision=fp8", "precision.fp8_emulate=true", "precision.recipe.scale_rule=rceil"], r"\(fp8_e4m3\)"),
    ],
)
def test_a_recipe_switch_no_planned_layer_can_use_names_the_key(overrides, message):
    """Which formats a switch reaches is a fact of the plan (rules, high blocks and the kernel's
    layers decide it), checked once, as the layers are planned."""
    config = compose_cfg(*GPT, *overrides)
    validate(config)
    with pytest.raises(ConfigError, match=message):
        build(config)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["model.hidden=[]"], "precision=mxfp8: Sequential has no Linear layer to quantize but its output head"),
        ([*GPT, "precision.high_last=2"], "precision.high_last=2: with precision.high_first=0 and high_last=2 all 2"),
        ([*GPT, "precision.high_first=1", "precision.high_last=1"], "precision.high_last=1: .* all 2 blocks"),
        ([*GPT, "precision.rules=[{match: 'blocks.*', format: high}]"], r"precision.rules\[0\].match=blocks.\*: sends"),
    ],
)
def test_a_plan_with_nothing_to_quantize_names_its_cause(overrides, message):
    """The digits MLP's one Linear layer is its head, kept high; the GPT's two blocks sent high by
    precision.high_first/high_last or by a rule: each error names the setting that did it."""
    with pytest.raises(ConfigError, match=message):
        build(compose_cfg("precision=mxfp8", *overrides))


def test_recipe_switches_apply_to_the_formats_that_can_use_them():
    """The rules example of docs/guide/layers.md: the attention in mxfp8, the rest in nvfp4 with its whole
    recipe. Square weight blocks reach the nvfp4 layers alone (mxfp8 has none), the other switches every quantized
    layer, and the start of the run says so."""
    rules = "precision.rules=[{match: '*.attn.*', format: mxfp8}, {match: 'blocks.0.*', format: high}]"
    c = build(compose_cfg(*GPT, "precision=nvfp4", rules))
    layers = {n: m for n, m in c.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert {n: (m.format, m.recipe.weight_2d) for n, m in layers.items()} == {
        "blocks.0.attn.qkv": ("mxfp8", False), "blocks.0.attn.proj": ("mxfp8", False),
        "blocks.1.attn.qkv": ("mxfp8", False), "blocks.1.attn.proj": ("mxfp8", False),
        "blocks.1.mlp.fc": ("nvfp4", True), "blocks.1.mlp.proj": ("nvfp4", True),
    }  # fmt: skip
    assert all(m.recipe.stochastic_grads and m.recipe.hadamard for m in layers.values())
    reach = (
        "recipe: weight_2d applies to the nvfp4 layers, not to mxfp8: no square blocks (nvfp4 16x16, fp8_block 128x128)"
    )
    assert c.stepper.policy.notes == [reach, quantized.gemm_note("cpu")]  # and how the GEMMs compute here
    with pytest.raises(ConfigError, match=r"weight_2d=true: is for formats with square blocks .* \(mxfp8\)"):
        build(compose_cfg(*GPT, "precision=nvfp4", "precision.rules=[{match: '*', format: mxfp8}]"))


def rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_an_nvfp4_gpt_trains_logs_its_layers_and_resumes_with_the_same_draws(tmp_path):
    """The full NVFP4 recipe (stochastic rounding of gradients included) with accumulation: the
    first row counts the layers per format, and a run stopped at step 3 and resumed logs the same
    losses as one that was not."""
    steps = ["precision=nvfp4", "precision.high_last=1", "accum=2", "sched.warmup_steps=1", "trainer.log_every=1",
             "trainer.val_every=0", "sched.total_steps=6"]  # fmt: skip
    whole = run(compose_cfg(*GPT, *steps, "trainer.max_steps=6"), tmp_path / "whole")
    first = rows(tmp_path / "whole")[0]
    assert first["precision/layers/nvfp4"] == 4 and first["precision/layers/high"] == 5
    assert first["precision/kernel"] == "emulated"
    run(compose_cfg(*GPT, *steps, "trainer.max_steps=3"), tmp_path / "parts")
    resumed = run(compose_cfg(*GPT, *steps, "trainer.max_steps=6", "resume=auto"), tmp_path / "parts")
    losses = [r["train/loss"] for r in rows(tmp_path / "whole")]
    assert [r["train/loss"] for r in rows(tmp_path / "parts")] == losses
    assert resumed["val/loss"] == whole["val/loss"] and losses[-1] < losses[0] - 0.5


def test_quantization_statistics_by_hand():
    """mxfp4, one block of 32 inputs: 7, 0.2 and thirty 1s. The floor scale is 2^(2 - 2) = 1, so 7
    saturates to 6, 0.2 rounds to 0 (underflow) and the 1s are exact."""
    layer = QuantizedLinear(32, 1, False, "mxfp4", Recipe(), seed=0)
    layer.stats = {}
    x = torch.tensor([[7.0, 0.2] + [1.0] * 30])
    layer(x).sum().backward()
    sq_err, sq_norm, count, nonzero, under, saturated = layer.stats["input"].tolist()
    assert (count, nonzero, under, saturated) == (32, 32, 1, 1)
    assert sq_err == pytest.approx(1 + 0.2**2) and sq_norm == pytest.approx(49 + 0.2**2 + 30)
    assert set(layer.stats) == {"input", "weight", "grad_output", "wgrad_exact", "wgrad_noise"}  # and dW's noise


def test_diagnostics_log_where_the_bits_go(tmp_path):
    cfg = compose_cfg(*GPT, "precision=mxfp4", "diagnostics=grads", "trainer.max_steps=2", "trainer.log_every=1")
    run(cfg, tmp_path)
    first = rows(tmp_path)[0]
    layers = [k.split("/")[1] for k in first if k.startswith("quant/") and k.endswith("/input/rel_err")]
    assert layers == [f"blocks.{b}.{m}" for b in (0, 1) for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
    errors = [v for k, v in first.items() if k.startswith("quant/") and k.endswith("/rel_err")]
    assert len(errors) == 24 and all(0.01 < e < 0.5 for e in errors)  # E2M1 keeps about 1 significant bit
    assert first["diag/quant_rel_err"] == pytest.approx(sum(errors) / 24)
    assert first["diag/quant_rel_err_max"] == max(errors)
    assert all(0 <= first[k] <= 1 for k in first if k.endswith(("/underflow", "/saturated")))


@pytest.mark.slow
def test_a_vit_and_fp16_autocast_with_a_loss_scaler_train_with_formats(tmp_path):
    """timm's ViT (built for 32x32 inputs, its blocks named), its last block and head high; the
    digits MLP in mxfp8 inside fp16 autocast, its loss scaled."""
    vit = ["model=timm", "model.name=vit_tiny_patch16_224", "data=synthetic", "data.shape=[3,32,32]"]
    summary = run(
        compose_cfg(*vit, "precision=mxfp8", "precision.high_last=1", "trainer.max_steps=2"), tmp_path / "vit"
    )
    first = rows(tmp_path / "vit")[0]
    assert first["precision/layers/mxfp8"] == 44 and first["precision/layers/high"] == 5  # 11 blocks x 4 + head
    assert summary["train/loss"] < 2.5
    fp16 = run(compose_cfg("precision=mxfp8", "precision.autocast=float16", "trainer.max_steps=60"), tmp_path / "fp16")
    assert fp16["scaler/final_scale"] > 1 and fp16["val/acc"] > 0.85


NATIVE = [
    "precision=bf16",
    "precision.format=fp8_e4m3",
    "precision.recipe.grad_format=fp8_e5m2",
    "precision.kernel=native",
]


@pytest.mark.slow
def test_the_native_kernel_is_torchaos_float8_computing_the_same_format(tmp_path):
    """precision.kernel=native: torchao's Float8Linear for fp8_e4m3 with e5m2 gradients (its
    tensorwise recipe), run here in torchao's emulation; it quantizes autocast's bf16 copies and
    returns bf16, so it trains as the emulated layers do, not to the bit."""
    steps = ["trainer.max_steps=150", "trainer.log_every=50", "trainer.val_every=0"]
    native = run(compose_cfg(*NATIVE, "precision.fp8_emulate=true", *steps), tmp_path / "native")
    emulated = run(compose_cfg(*NATIVE[:-1], *steps), tmp_path / "emulated")
    first = rows(tmp_path / "native")[0]
    assert first["precision/kernel"] == "torchao" and first["precision/layers/fp8_e4m3"] == 2
    assert rows(tmp_path / "emulated")[0]["precision/kernel"] == "emulated"
    assert native["train/loss"] == pytest.approx(emulated["train/loss"], abs=0.05)
    kinds = {type(m).__name__ for m in build(compose_cfg(*NATIVE, "precision.fp8_emulate=true")).model.modules()}
    assert "Float8Linear" in kinds and "QuantizedLinear" not in kinds


@pytest.mark.parametrize(
    "overrides, message",
    [
        (NATIVE, "float8 matmuls need a CUDA GPU of compute capability 8.9"),
        (["precision=mxfp8", "precision.kernel=native"], "torchao has no training kernel for format=mxfp8 with"),
        ([*NATIVE, "precision.recipe.stochastic_grads=true"], "float8 kernel has no precision.recipe.stochastic"),
        (["precision=fp8", "precision.recipe.hadamard=true"], "float8 kernel has no precision.recipe.hadamard"),
        ([*NATIVE[1:], "precision=fp16"], "float8 layers run inside bf16 autocast on fp32 weights, not precision=fp16"),
    ],
)
def test_native_kernel_config_errors(overrides, message):

    if overrides == NATIVE and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        pytest.skip("this GPU has fp8 tensor cores")
    cfg = compose_cfg(*overrides)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)
        config = typed(cfg)
        resolve_device(config.trainer.device, config.precision)


@pytest.mark.slow
def test_a_compiled_model_keeps_its_quantized_layers_eager_with_the_eager_values(monkeypatch):
    # ~10 s: inductor compiles the plain layers around the quantized one on the CPU
    traced = []  # per call of the quantizer: whether torch.compile was tracing it

    def spy(*args, **kwargs):
        traced.append(torch.compiler.is_compiling())
        return real(*args, **kwargs)

    real = quantized.quantize
    monkeypatch.setattr(quantized, "quantize", spy)
    torch.manual_seed(0)
    inner = QuantizedLinear.from_linear(nn.Linear(64, 32), "nvfp4", Recipe(stochastic_grads=True, hadamard=True), 3)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), inner, nn.Linear(32, 8))
    x = torch.randn(48, 32)
    grads = []
    for compiled in (False, True):
        inner.backward_passes = 0  # the same stochastic draws in both passes
        if compiled:
            keep_eager(model)
            net = torch.compile(model)
        model.zero_grad()
        out = (net if compiled else model)(x)
        out.square().sum().backward()
        grads.append([out.detach(), *(p.grad.clone() for p in model.parameters())])
    assert len(traced) == 2 * 6 and not any(traced), traced  # 6 quantized operands a pass, none traced
    for eager, compiled in zip(*grads, strict=True):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
