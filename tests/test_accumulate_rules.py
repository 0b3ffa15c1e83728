"""Accumulation per layer and in attention: a precision.rules entry's `accumulate` reaches its layers
alone (the recipe's per-GEMM presets still first), attention's six GEMMs sum as the forward's and the
backward's presets say (against accumulate.matmul by hand), and the config's one-line errors."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

from halfprec.config import validate
from halfprec.config.saved import saved
from halfprec.config.schema import QuantRule as Rule
from halfprec.errors import ConfigError
from halfprec.numerics import accumulate as acc
from halfprec.numerics import quantized
from halfprec.numerics.attention import AttentionRecipe, QuantizedAttention, causal_softmax
from halfprec.numerics.formats import quantize
from halfprec.numerics.formats.elements import ELEMENTS
from halfprec.numerics.layers import shadowed_rules
from halfprec.numerics.quantized import QuantizedLinear, Recipe

from helpers import TRAIN, build_from, compose_cfg, typed_cfg

GPT = ["task=lm", "model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=16", "data.batch_size=4"]
GFDPA = acc.gfdpa  # the 4-bit block-scaled instruction, before a test spies on it
FP8_RULE = "precision.rules=[{match: 'blocks.0.*', format: fp8_e4m3_row, accumulate: hopper_promoted}]"


@pytest.fixture(autouse=True)
def fp32_gemms(monkeypatch):
    """The references are fp32 products; so are the layers' (test_quantized.py's fixture)."""
    monkeypatch.setattr(quantized, "cpu_bf16", lambda: False)


def presets(module: torch.nn.Module) -> dict[str, str]:
    return {g: a.name for g, a in module.accumulate.items()}


def test_a_rules_accumulate_reaches_only_its_layers_and_the_recipes_per_gemm_presets_win():
    c, _ = build_from(*GPT, "precision=fp8_row", "precision.kernel=emulated", FP8_RULE,
                      "precision.accumulate=hopper", "precision.recipe.wgrad_accumulate=exact")  # fmt: skip
    layers = {n: m for n, m in c.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert {n for n in layers if n.startswith("blocks.0.")} == {"blocks.0.attn.qkv", "blocks.0.attn.proj",
                                                                "blocks.0.mlp.fc", "blocks.0.mlp.proj"}  # fmt: skip
    for name, layer in layers.items():
        rule = "hopper_promoted" if name.startswith("blocks.0.") else "hopper"
        assert presets(layer) == {"forward": rule, "dgrad": rule, "wgrad": "exact"}, name


def test_a_rule_reaches_an_attention_core_and_attentions_own_presets_win():
    rules = "precision.rules=[{match: blocks.0.attn.core, format: fp8_e4m3_row, accumulate: hopper}]"
    c, _ = build_from(*GPT, "precision=bf16", "precision.attention.format=fp8_e4m3_row", rules,
                      "precision.attention.backward_accumulate=hopper_promoted")  # fmt: skip
    cores = {n: presets(m) for n, m in c.model.named_modules() if isinstance(m, QuantizedAttention)}
    assert cores == {"blocks.0.attn.core": {"forward": "hopper", "backward": "hopper_promoted"},
                     "blocks.1.attn.core": {"forward": "exact", "backward": "hopper_promoted"}}  # fmt: skip


def qkv(shape=(2, 2, 64, 32), seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for _ in range(3)]


def core(fmt: str, accumulate: str, **attention) -> QuantizedAttention:
    return QuantizedAttention(fmt, AttentionRecipe(format=fmt, **attention), Recipe(), 5, accumulate)


def by_hand(t: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp8_e4m3 (one fp32 scale per tensor) as a GEMM takes it: the elements' values, the scale apart."""
    q = quantize(t.detach().reshape(-1, *t.shape[-2:]), "fp8_e4m3", axis, split=True)
    return q.values, q.factor


def hopper_bmm(a: tuple, b: tuple) -> torch.Tensor:
    """Each matrix of a batch as wgmma sums it (accumulate.matmul), times the two tensor scales."""
    sub = ELEMENTS["e4m3"].emin
    (av, af), (bv, bf) = a, b
    out = torch.stack([acc.matmul(av[i], bv[i], acc.WGMMA_FP8, (sub, sub)) for i in range(av.shape[0])])
    return out * (af * bf)


def test_attentions_forward_gemms_are_accumulate_matmul_by_hand():
    """S = QK^T and O = PV under hopper: wgmma's 13-bit sums of the quantized operands, bit for bit."""
    q, k, v = qkv()
    out = core("fp8_e4m3", "hopper")(q, k, v)
    (qv, qf), (kv, kf) = by_hand(q, -1), by_hand(k, -1)
    s = hopper_bmm((qv, qf), (kv.transpose(-2, -1), kf))
    p = causal_softmax(s, 1 / math.sqrt(q.shape[-1]))
    want = hopper_bmm(by_hand(p, -1), by_hand(v, -2)).reshape(out.shape)
    assert torch.equal(out.detach(), want)
    exact = core("fp8_e4m3", "exact")(q, k, v).detach()
    assert not torch.equal(out.detach(), exact)  # the reference can fail: 13 bits are not fp32's sums
    assert (out.detach() - exact).norm() < 1e-2 * exact.norm()  # an element of P may round to another fp8 value


def test_the_backward_gemms_sum_as_the_backwards_preset_alone():
    q, k, v = qkv()
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))

    def attend(c):
        out = c(q, k, v)
        return out.detach(), torch.autograd.grad(out, (q, k, v), dout)

    exact, exact_grads = attend(core("fp8_e4m3", "exact"))
    out, grads = attend(core("fp8_e4m3", "exact", backward_accumulate="hopper"))
    assert torch.equal(out, exact)
    assert all(not torch.equal(g, e) for g, e in zip(grads, exact_grads))
    assert all((g - e).norm() < 1e-2 * e.norm() for g, e in zip(grads, exact_grads))


def test_block_scaled_attention_sums_on_blackwell_and_has_no_instruction_on_hopper(monkeypatch):
    """MXFP4's elements and E8M0 scales go to tcgen05's block-scaled instruction (its groups of 16)."""
    calls = []
    monkeypatch.setattr(acc, "gfdpa", lambda *args: calls.append(args[-2]) or GFDPA(*args))
    q, k, v = qkv((1, 2, 64, 32))
    out = core("mxfp4", "blackwell")(q, k, v).detach()
    assert calls and set(calls) == {acc.TCGEN05_MXF4NVF4}
    torch.testing.assert_close(out, core("mxfp4", "exact")(q, k, v).detach(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ConfigError, match=r"^precision.accumulate=hopper: hopper has no MMA instruction for a fp4 "
                       r"GEMM \(forward in mxfp4\)"):  # fmt: skip
        core("mxfp4", "hopper")
    key = r"^precision.attention.backward_accumulate=ampere: ampere has no MMA instruction for a mx GEMM"
    with pytest.raises(ConfigError, match=key):
        core("mxfp8", "exact", backward_accumulate="ampere")


def test_hopper_with_mxfp4_attention_is_one_config_error_at_build():
    with pytest.raises(ConfigError, match=r"^precision.accumulate=hopper: hopper has no MMA instruction for a fp4"):
        build_from(*GPT, "precision=bf16", "precision.attention.format=mxfp4", "precision.accumulate=hopper")


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        (["precision.rules=[{match: '*', format: mxfp8, accumulate: volta}]"],
         r"^precision.rules\[0\].accumulate=volta: an accumulation preset: exact, hopper"),
        (["precision=mxfp8", "precision.rules=[{match: 'blocks.0.*', format: high, accumulate: hopper}]"],
         r"^precision.rules\[0\].accumulate=hopper: .*keeps its layers high"),
        (["precision=fp8", "precision.rules=[{match: '*', format: fp8_e4m3, accumulate: hopper}]"],
         r"^precision.rules\[0\].accumulate=hopper: .*precision.kernel=emulated"),
        (["precision=mxfp8", "precision.attention.forward_accumulate=hopper"],
         r"^precision.attention.forward_accumulate=hopper: .*set precision.attention.format"),
        (["precision.rules=[{match: '*', format: mxfp8, sums: hopper}]"], r"optionally accumulate: <preset>"),
    ],
)  # fmt: skip
def test_accumulate_settings_that_cannot_work_are_one_line_errors(overrides, error):
    with pytest.raises(ConfigError, match=error):
        validate(compose_cfg(*GPT, *overrides))


def test_a_rule_shadowed_by_one_of_another_accumulate_is_an_error():
    from halfprec.components.models.gpt import create_gpt

    model = create_gpt((16,), 50, n_layer=2, n_embd=16, n_head=2, block_size=16)
    rules = [Rule("blocks.*", "fp8_e4m3"), Rule("blocks.0.*", "fp8_e4m3", "hopper")]
    with pytest.raises(ConfigError, match=r"^precision.rules\[1\].match=blocks.0.\*: every layer it matches is taken"):
        shadowed_rules(model, rules)
    assert len(shadowed_rules(model, [rules[0], Rule("blocks.0.*", "fp8_e4m3")])) == 1  # a no-op: a warning


def test_saved_rules_name_accumulate_only_where_set():
    """A rule without it is saved as before the key existed (a resume compares the saved configs)."""
    cfg = typed_cfg(*GPT, "precision=mxfp8", "precision.rules=[{match: 'blocks.0.*', format: high}]")
    assert saved(cfg)["precision"]["rules"] == [{"match": "blocks.0.*", "format": "high"}]
    cfg = typed_cfg(*GPT, "precision=fp8_row", "precision.kernel=emulated", FP8_RULE)
    assert saved(cfg)["precision"]["rules"][0]["accumulate"] == "hopper_promoted"


def test_cli_a_bad_preset_in_a_rule_is_one_line_and_exit_2(tmp_path):
    args = [*GPT, "precision=mxfp8", "precision.rules=[{match: '*.mlp.*', format: mxfp8, accumulate: volta}]",
            "logger=none", f"hydra.run.dir={tmp_path}"]  # fmt: skip
    done = subprocess.run([sys.executable, str(TRAIN), *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1
    assert done.stderr.startswith("error: precision.rules[0].accumulate=volta: an accumulation preset: exact, hopper")


def test_evaluation_layers_sum_as_the_runs_where_the_preset_has_an_instruction():
    """precision.eval: fp8_e4m3_row's layers sum as hopper (the rule's hopper_promoted for blocks.0),
    mxfp4's exactly (Hopper has no MXFP4 MMA), and the start line says so."""
    from halfprec.numerics.evaluation import eval_layer

    c, _ = build_from(*GPT, "precision=fp8_row", "precision.kernel=emulated", FP8_RULE, "precision.accumulate=hopper",
                      "precision.eval=[fp8_e4m3_row,mxfp4]")  # fmt: skip
    policy = c.stepper.policy
    row, mx = policy.evals
    name = "blocks.1.mlp.fc"
    assert (row.sums(name), row.sums("blocks.0.mlp.fc"), mx.sums(name)) == ("hopper", "hopper_promoted", "exact")
    layer = eval_layer(c.model.get_submodule(name), "fp8_e4m3_row", row, name)
    assert presets(layer) == dict.fromkeys(("forward", "dgrad", "wgrad"), "hopper")
    note = next(n for n in policy.notes if n.startswith("eval:"))
    assert "fp8_e4m3_row (8 layers, summed as hopper, hopper_promoted)" in note
    assert "mxfp4 (8 layers, exactly where hopper, hopper_promoted have no mxfp4 MMA)" in note
