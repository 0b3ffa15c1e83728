"""Attention's GEMMs in a number format (numerics/attention.py): the explicit attention against torch's
fused one, each quantized GEMM against the product written out by hand with fake_quantize, the
gradients against finite differences, the Hadamard transform of Q and K; the plan's rules and
schedules reaching attention, the config's errors, and the CLI as a user runs it."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from halfprec.config import validate
from halfprec.config.schema import Phase
from halfprec.config.schema import QuantRule as Rule
from halfprec.errors import ConfigError
from halfprec.numerics import quantized
from halfprec.numerics.attention import AttentionRecipe, QuantizedAttention, ScaledDotProduct, StochasticAttention
from halfprec.numerics.formats import fake_quantize as fq
from halfprec.numerics.layers import plan_layers
from halfprec.numerics.quantized import QuantizedLinear, Recipe, quant_sums
from halfprec.numerics.schedule import build_schedule
from halfprec.numerics.settings import HIGH
from halfprec.training.diagnostics import Diagnostics

from helpers import TRAIN, build_from, compose_cfg

GPT = ["task=lm", "model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=16", "data.batch_size=4"]

HIGH_GEMMS = AttentionRecipe(format="mxfp8", forward="high", backward="high")


@pytest.fixture(autouse=True)
def fp32_gemms(monkeypatch):
    """The references here are fp32 or fp64 products; so are the core's (test_quantized.py's fixture)."""
    monkeypatch.setattr(quantized, "cpu_bf16", lambda: False)


def qkv(shape=(2, 3, 40, 32), dtype=torch.float32, seed=0, outlier=1.0):
    """Queries, keys and values (batch, heads, tokens, d) that need gradients; `outlier`: a channel
    of q that many times the others."""
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(shape, generator=gen, dtype=dtype) for _ in range(3))
    q[..., 3] *= outlier
    return [t.requires_grad_() for t in (q, k, v)]


def attend(core: torch.nn.Module, q, k, v, seed=1):
    """The core's output and the gradients of q, k, v for a random output gradient."""
    out = core(q, k, v)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    return out.detach(), grads, dout


def core(fmt="mxfp8", **kwargs) -> QuantizedAttention:
    return QuantizedAttention(fmt, AttentionRecipe(format=fmt, **kwargs), Recipe(), seed=5)


def test_the_explicit_attention_in_high_precision_equals_torchs_fused_one():
    q, k, v = qkv()
    out, grads, _ = attend(QuantizedAttention("mxfp8", HIGH_GEMMS, Recipe(), 0), q, k, v)
    want, want_grads, _ = attend(ScaledDotProduct(), q, k, v)
    torch.testing.assert_close(out, want)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected)


def reference(q, k, v, dout, fmt):
    """Each GEMM written out: its operands quantized by hand along the dimension it contracts
    (fake_quantize, the outer scales included), multiplied in fp64; softmax and scaling explicit."""
    q, k, v = (t.detach() for t in (q, k, v))
    scale = 1 / math.sqrt(q.shape[-1])
    s = fq(q, fmt, -1).double() @ fq(k, fmt, -1).double().transpose(-2, -1)
    causal = torch.ones(s.shape[-2:], dtype=torch.bool).tril()
    p = torch.softmax((s.float() * scale).masked_fill(~causal, float("-inf")), -1)
    o = fq(p, fmt, -1).double() @ fq(v, fmt, -2).double()
    dv = fq(p, fmt, -2).double().transpose(-2, -1) @ fq(dout, fmt, -2).double()
    dp = fq(dout, fmt, -1).double() @ fq(v, fmt, -1).double().transpose(-2, -1)
    ds = p * (dp.float() - (dout * o.float()).sum(-1, keepdim=True)) * scale
    dq = fq(ds, fmt, -1).double() @ fq(k, fmt, -2).double()
    dk = fq(ds, fmt, -2).double().transpose(-2, -1) @ fq(q, fmt, -2).double()
    return o.float(), (dq.float(), dk.float(), dv.float())


@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4", "fp8_e4m3_row", "fp8_block"])
def test_each_quantized_gemm_equals_its_operands_quantized_by_hand(fmt):
    q, k, v = qkv()
    out, grads, dout = attend(core(fmt), q, k, v)
    want, want_grads = reference(q, k, v, dout, fmt)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    for got, expected in zip(grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_blocking_p_and_v_along_another_axis_would_give_other_values():
    """The reference can fail: P and V blocked along the queries and d instead of the keys."""
    q, k, v = (t.detach() for t in qkv())
    out = core("mxfp4")(q, k, v)
    s = fq(q, "mxfp4", -1) @ fq(k, "mxfp4", -1).transpose(-2, -1) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf")), -1)
    torch.testing.assert_close(out, fq(p, "mxfp4", -1) @ fq(v, "mxfp4", -2), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(out, fq(p, "mxfp4", -2) @ fq(v, "mxfp4", -1), atol=1e-3)


def test_the_gradients_are_the_derivatives_of_the_forward_in_fp64():
    """Finite differences check the hand-written backward (softmax's, the scaling, the transposes)
    where it is differentiable: with the GEMMs high (a format's rounding is piecewise constant, and
    its backward passes gradients straight through it, as the hardware's does)."""
    q, k, v = qkv(shape=(1, 2, 6, 4), dtype=torch.float64)
    attention = QuantizedAttention("mxfp8", HIGH_GEMMS, Recipe(), 0)
    assert torch.autograd.gradcheck(lambda q, k, v: attention(q, k, v), (q, k, v))


def test_a_forward_or_backward_alone_quantized():
    """forward=high keeps S and O exact; backward=high keeps the four gradient GEMMs exact."""
    q, k, v = qkv()
    want, want_grads, _ = attend(ScaledDotProduct(), q, k, v)
    out, grads, _ = attend(core(forward="high"), q, k, v)
    torch.testing.assert_close(out, want)
    assert not torch.allclose(grads[0], want_grads[0], rtol=1e-3)
    out, grads, dout = attend(core(backward="high"), q, k, v)
    assert not torch.allclose(out, want, rtol=1e-3)


def test_the_hadamard_leaves_qk_unchanged_and_changes_the_quantized_attention():
    q, k, v = qkv(outlier=20.0)
    rotating = core(hadamard=True)
    qr, kr = rotating.rotated(q.detach(), k.detach())
    assert not torch.allclose(qr, q)
    torch.testing.assert_close(qr @ kr.transpose(-2, -1), q @ k.transpose(-2, -1), rtol=1e-5, atol=1e-4)
    plain, _, _ = attend(core(), q, k, v)
    rotated, _, _ = attend(rotating, q, k, v)
    assert not torch.equal(plain, rotated)
    # spread over the head, the outlier channel costs the other values of its blocks less: the
    # logits' quantization error is smaller
    q, k = q.detach(), k.detach()
    exact = q @ k.transpose(-2, -1)
    error = (fq(q, "mxfp8", -1) @ fq(k, "mxfp8", -1).transpose(-2, -1) - exact).norm()
    assert (fq(qr, "mxfp8", -1) @ fq(kr, "mxfp8", -1).transpose(-2, -1) - exact).norm() < error


def test_the_output_comes_in_the_autocast_dtype_and_gradients_in_the_inputs():
    q, k, v = qkv(shape=(1, 2, 8, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = core()(q, k, v)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad is not None and q.grad.dtype == torch.float32


# statistics (diagnostics=grads) and stochastic rounding


def mxfp4_sums(t: torch.Tensor, axis: int) -> torch.Tensor:
    """quant_sums of `t` and its mxfp4 fake_quantize along `axis`, the saturated values counted by hand:
    those past E2M1's largest value, 6, times their block's floor scale 2^(floor(log2 amax) - 2)."""
    t = t.detach().float()
    blocks = t.movedim(axis, -1).unflatten(-1, (-1, 32)).abs()
    scale = 2.0 ** (blocks.amax(-1, keepdim=True).log2().floor() - 2)
    return quant_sums(t, fq(t, "mxfp4", axis), (blocks / scale > 6).sum())


def stats_of(attention: QuantizedAttention, q, k, v):
    """The statistics the core keeps over one forward and backward, and what it saw: P and dS by hand
    (reference's, in fp32) and dO."""
    attention.stats = {}
    out, _, dout = attend(attention, q, k, v)
    q, k, v, dout = (t.detach().flatten(0, 1) for t in (q, k, v, dout))
    scale = 1 / math.sqrt(q.shape[-1])
    quantized = attention.gemms["forward"] != HIGH
    s = fq(q, "mxfp4", -1) @ fq(k, "mxfp4", -1).transpose(-2, -1) if quantized else q @ k.transpose(-2, -1)
    p = torch.softmax((s * scale).masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf")), -1)
    v_for_dp = fq(v, "mxfp4", -1) if attention.gemms["backward"] != HIGH else v
    dp = fq(dout, "mxfp4", -1) @ v_for_dp.transpose(-2, -1)
    ds = p * (dp - (dout * out.flatten(0, 1)).sum(-1, keepdim=True)) * scale
    return attention.stats, (q, k, v, p, dout, ds)


def test_the_cores_statistics_are_its_operands_quantized_by_hand():
    """Each operand where first quantized, blocked as that GEMM blocks it: Q, K along d, P and V along
    the keys (the forward's); dO along the queries (dV's), dS along the keys (dQ's)."""
    q, k, v = qkv(shape=(1, 2, 64, 32), outlier=8.0)  # saturated values too
    stats, (q3, k3, v3, p, dout, ds) = stats_of(core("mxfp4"), q, k, v)
    assert list(stats) == ["query", "key", "probs", "value", "grad_output", "grad_scores"]
    for name, t, axis in (("query", q3, -1), ("key", k3, -1), ("value", v3, -2), ("grad_output", dout, -2)):
        assert torch.equal(stats[name], mxfp4_sums(t, axis)), name  # the tensors the core was given
    torch.testing.assert_close(stats["probs"], mxfp4_sums(p, -1), rtol=1e-4, atol=0)
    torch.testing.assert_close(stats["grad_scores"], mxfp4_sums(ds, -1), rtol=1e-4, atol=0)
    assert stats["query"][5] > 0 and stats["probs"][4] > 0  # the outlier saturates; small weights underflow


def test_with_the_forward_high_the_backward_records_q_k_v_and_p_and_with_both_high_nothing():
    q, k, v = qkv(shape=(1, 2, 64, 32))
    stats, (q3, k3, v3, p, _, _) = stats_of(core("mxfp4", forward="high"), q, k, v)
    # as dK = dS^T Q, dQ = dS K, dP = dO V^T and dV = P^T dO block them
    for name, t, axis in (("query", q3, -2), ("key", k3, -2), ("value", v3, -1)):
        assert torch.equal(stats[name], mxfp4_sums(t, axis)), name
    torch.testing.assert_close(stats["probs"], mxfp4_sums(p, -2), rtol=1e-4, atol=0)
    stats, _ = stats_of(core("mxfp4", backward="high"), q, k, v)
    assert set(stats) == {"query", "key", "value", "probs"}  # no gradient operand quantized


def test_stochastic_grads_round_do_and_ds_from_the_cores_seed_and_resume_exactly():
    recipe = Recipe(stochastic_grads=True)
    q, k, v = qkv(shape=(1, 2, 16, 32))
    cores = [StochasticAttention("mxfp4", AttentionRecipe(format="mxfp4"), recipe, seed=5) for _ in range(2)]
    first = [attend(c, q, k, v)[1] for c in cores]
    assert all(torch.equal(a, b) for a, b in zip(*first))  # seeded: the same draws
    nearest = attend(core("mxfp4"), q, k, v)[1]
    assert not torch.equal(first[0][0], nearest[0])
    second = attend(cores[0], q, k, v)[1]  # the next backward pass draws anew
    assert not torch.equal(second[0], first[0][0])
    resumed = StochasticAttention("mxfp4", AttentionRecipe(format="mxfp4"), recipe, seed=5)
    resumed.load_state_dict(cores[1].state_dict())
    assert all(torch.equal(a, b) for a, b in zip(attend(resumed, q, k, v)[1], second))


def quant_row(*overrides: str) -> dict:
    """The diagnostics row of the GPT's statistics (diagnostics=grads) over one forward and backward."""
    c, cfg = build_from(*GPT, "precision=mxfp4", "diagnostics=grads", *overrides)
    diag = Diagnostics(cfg.diagnostics, c.model, c.stepper.params)
    tokens = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    with diag.watch_quantization():
        c.model(tokens).float().square().mean().backward()
    return diag.collect()


def test_diagnostics_log_the_attention_cores_beside_the_linear_layers():
    """quant/<core>/<operand>/... keys for each core, in the model's mean; the Linear layers' keys as
    without quantized attention."""
    row, linear = quant_row("precision.attention.format=mxfp4"), quant_row()
    cores = {key for key in row if ".core/" in key}
    assert {k for k in row if k.startswith("quant/")} - cores == {k for k in linear if k.startswith("quant/")}
    operands = ("query", "key", "value", "probs", "grad_output", "grad_scores")
    stats = ("rel_err", "underflow", "saturated")
    assert cores == {f"quant/blocks.{b}.attn.core/{o}/{s}" for b in (0, 1) for o in operands for s in stats}
    errors = [v for k, v in row.items() if k.startswith("quant/") and k.endswith("/rel_err")]
    assert row["diag/quant_rel_err"] == pytest.approx(sum(errors) / len(errors))
    assert all(0 < row[k] < 1 for k in cores if k.endswith("/rel_err"))


# the plan, the config and the CLI


def gpt(n_layer=3):
    from halfprec.components.models.gpt import create_gpt

    return create_gpt((16,), 50, n_layer=n_layer, n_embd=16, n_head=2, block_size=16)


def test_rules_and_high_blocks_reach_attention_only_when_it_is_quantized():
    model = gpt()
    rules = [Rule("blocks.1.*", "nvfp4")]
    off = plan_layers(model, "mxfp8", rules, high_first=1)
    assert not any(name.endswith(".core") for name in off)  # torch's fused attention throughout
    on = plan_layers(model, "mxfp8", rules, high_first=1, attention="mxfp4")
    cores = {name: fmt for name, fmt in on.items() if name.endswith(".core")}
    assert cores == {"blocks.0.attn.core": HIGH, "blocks.1.attn.core": "nvfp4", "blocks.2.attn.core": "mxfp4"}
    assert {n: f for n, f in on.items() if n in off} == off  # the Linear layers' plan is the same


def test_a_rule_naming_only_attention_cores_wants_attention_quantized():
    with pytest.raises(ConfigError, match=r"rules\[0\].match=\*.core: matches only attention cores.*attention.format"):
        plan_layers(gpt(), "mxfp8", [Rule("*.core", "mxfp8")])


def test_a_schedule_phase_reaches_attentions_forward_or_backward():
    plan = {"blocks.0.attn.qkv": "mxfp8", "blocks.0.attn.core": "mxfp8"}
    phases = [Phase(format=HIGH, gemms=["wgrad"], from_step=2), Phase(format="mxfp4", gemms=["forward"], from_step=3)]
    recipe = AttentionRecipe(format="mxfp8")
    _, schedule = build_schedule(plan, phases, Recipe(), 10, recipe, {"blocks.0.attn.core"})
    assert schedule.labels(1) == {"blocks.0.attn.qkv": "mxfp8-mxfp8-high", "blocks.0.attn.core": "mxfp8-high"}
    assert schedule.labels(2)["blocks.0.attn.core"] == "mxfp4-high"


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["precision.attention.format=mxfp9"], r"precision.attention.format=mxfp9: no such number format"),
        (["precision.attention.hadamard=true"], r"attention.hadamard=true: .*set precision.attention.format"),
        (["precision=fp8", "precision.attention.format=mxfp8"], r"precision.kernel=native: torchao has no quantized"),
        (["precision.attention=mxfp8"], r"precision.attention=mxfp8: a mapping of format"),
        (["precision.attention.format=mxfp8", "precision.attention.forward=high", "precision.attention.backward=high"],
         r"keeps every attention GEMM high"),
    ],
)  # fmt: skip
def test_attention_settings_that_cannot_work_are_one_line_errors(overrides, error):
    with pytest.raises(ConfigError, match=error):
        validate(compose_cfg(*overrides))


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["precision=bf16", "precision.attention.format=mxfp8"], r"Sequential has no attention core"),  # the MLP
        ([*GPT, "precision=bf16", "precision.attention.format=mxfp8", "model.dropout=0.1"], r"model.dropout=0.1"),
    ],
)
def test_a_model_without_an_attention_core_or_with_dropout_is_an_error_at_build(overrides, error):
    with pytest.raises(ConfigError, match=error):
        build_from(*overrides)


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        # the rule takes the attention cores too: the line names them
        (["precision=mxfp8", "precision.rules=[{match:'*',format:high}]"],
         r"rules\[0\].match=\*: sends every Linear layer and attention core left to quantize high"),
        # only attention quantized: the rule or the high blocks that keep it high, not "no Linear layer"
        (["precision=bf16", "precision.rules=[{match:'*.core',format:high}]"],
         r"rules\[0\].match=\*.core: sends every Linear layer and attention core"),
        (["precision=bf16", "precision.high_first=1", "precision.high_last=1"],
         r"precision.high_last=1: .*all 2 blocks of this model stay high"),
    ],
)  # fmt: skip
def test_a_plan_that_keeps_quantized_attention_high_names_the_setting(overrides, error):
    with pytest.raises(ConfigError, match=error):
        build_from(*GPT, "precision.attention.format=mxfp8", *overrides)


ROUNDS = "recipe: stochastic_grads rounds attention's gradient operands (dO, dS) only: "


@pytest.mark.parametrize(
    ("overrides", "note"),
    [
        # attention's backward GEMMs round dO and dS stochastically: the switch is not idle
        (["precision=mxfp8", "precision.recipe.dgrad=high", "precision.recipe.wgrad=high"],
         ROUNDS + "the GEMMs it acts in (dgrad, wgrad) are high"),
        (["precision=bf16"], ROUNDS + "no Linear layer is quantized"),
        (["precision=bf16", "precision.attention.backward=high"],
         "recipe: stochastic_grads does nothing: no Linear layer is quantized"),
    ],
)  # fmt: skip
def test_stochastic_grads_with_quantized_attention_says_where_it_rounds(overrides, note):
    c, _ = build_from(*GPT, "precision.attention.format=mxfp8", "precision.recipe.stochastic_grads=true", *overrides)
    assert [line for line in c.stepper.policy.notes if "stochastic_grads" in line] == [note]


def test_the_mx_scale_rule_reaches_attention_alone():
    """precision.recipe.scale_rule=rceil where only attention is quantized (in an MX format) rounds its
    operands' scales: no error; attention in nvfp4 has none, and the line says so."""
    c, _ = build_from(*GPT, "precision=bf16", "precision.attention.format=mxfp8", "precision.recipe.scale_rule=rceil")
    assert c.model.get_submodule("blocks.0.attn.core").recipe.scale_rule == "rceil"
    with pytest.raises(ConfigError, match=r"scale_rule=rceil: is for formats with E8M0 .*\(attention nvfp4\)"):
        build_from(*GPT, "precision=bf16", "precision.attention.format=nvfp4", "precision.recipe.scale_rule=rceil")


def test_the_converted_gpt_computes_attention_in_its_format():
    c, _ = build_from(*GPT, "precision=bf16", "precision.attention.format=nvfp4", "precision.attention.backward=high")
    core = c.model.get_submodule("blocks.0.attn.core")
    assert isinstance(core, QuantizedAttention) and core.gemms == {"forward": "nvfp4", "backward": HIGH}
    assert not any(isinstance(m, QuantizedLinear) for m in c.model.modules())  # precision.format is null
    assert set(c.model.state_dict()) == set(build_from(*GPT, "precision=bf16")[0].model.state_dict())


@pytest.mark.slow
def test_cli_trains_the_gpt_with_attention_in_mxfp8(tmp_path):
    """As a user runs it: the start table lists the attention cores, the first row counts them."""
    args = [*GPT, "precision=mxfp8", "precision.attention.format=mxfp8", "precision.attention.hadamard=true",
            "trainer.max_steps=2", "trainer.val_every=0", "logger=none", "trainer.progress=false",
            f"hydra.run.dir={tmp_path}"]  # fmt: skip
    done = subprocess.run([sys.executable, str(TRAIN), *args], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert "attention: mxfp8    2  blocks.0.attn.core, blocks.1.attn.core" in done.stderr
    first = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert first["precision/attention/mxfp8"] == 2 and math.isfinite(first["train/loss"])


@pytest.mark.slow
def test_compiled_gpt_with_quantized_attention_logs_the_eager_rows(cli):
    """trainer.compile=true: the quantized layers and attention cores stay eager (keep_eager), inductor
    compiles the rest, and validation (precision.eval's too) runs on the eager model: the same losses
    as without compile, to the fused kernels' rounding of the rest."""
    args = [*GPT, "model.n_layer=1", "precision=mxfp8", "precision.attention.format=mxfp8", "precision.eval=[mxfp4]",
            "trainer.max_steps=3", "trainer.val_every=3", "logger=none"]  # fmt: skip
    compiled = cli.submit(*args, "trainer.compile=true", timeout=900)
    eager = cli.run(*args, timeout=900).check()
    rows = {"compiled": compiled.result().check().metrics(), "eager": eager.metrics()}
    for key in ("train/loss", "val/loss", "val/loss@mxfp4"):
        got, want = ([r[key] for r in rows[run] if key in r] for run in ("compiled", "eager"))
        assert len(want) == (3 if key == "train/loss" else 1) and got == pytest.approx(want, rel=1e-5), key
