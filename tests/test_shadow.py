"""What-if ("shadow") quantization statistics (diagnostics.shadow): the statistics a format would have
on every Linear layer's operands, by hand and against quantize, logged for every layer of a run in any
precision, and leaving the run's values as they were bit for bit."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from halfprec.config import validate
from halfprec.errors import ConfigError
from halfprec.numerics.attention import ScaledDotProduct, causal_softmax
from halfprec.numerics.formats import FORMATS, quantize
from halfprec.training.diagnostics import Diagnostics
from halfprec.training.run import run

from helpers import build_from, compose_cfg, same_bits

GPT = ["task=lm", "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=4"]
OPERANDS = ("input", "weight", "grad_output")


def shadowed(model: nn.Module, formats: list[str], attention: bool = False) -> Diagnostics:
    """Diagnostics of `model` with the shadow formats alone (every step due); `attention`: its cores too."""
    cfg = SimpleNamespace(every=1, activations=False, skips=False, shadow=formats, shadow_attention=attention)
    names = [name for name, _ in model.named_parameters()]
    return Diagnostics(cfg, model, SimpleNamespace(names=names))  # type: ignore[arg-type]


def rel_err(t: torch.Tensor, fmt: str) -> float:
    """||q(t) - t|| / ||t||, t blocked along its last axis in `fmt`, rounded to nearest."""
    t = t.detach().float()
    return float((quantize(t, fmt, -1).values - t).norm() / t.norm())


def test_shadow_statistics_by_hand_and_against_quantize():
    """mxfp4, one block of 32 inputs: 7, 0.2 and thirty 1s. The floor scale is 2^(2 - 2) = 1, so 7
    saturates to 6, 0.2 rounds to 0 (underflow) and the 1s are exact. The output gradient is blocked
    along `out` (per token), not along the tokens: [5, 1, 1, 1] keeps scale 1 and 5 rounds to 4 (ties
    to even), [0.1] * 4 gets 2^-6 and each saturates to 6 * 2^-6."""
    linear = nn.Linear(32, 4, bias=False)
    diag = shadowed(nn.Sequential(linear), ["mxfp4", "nvfp4"])
    x = torch.tensor([[7.0, 0.2] + [1.0] * 30, [0.5] * 32])
    dy = torch.tensor([[5.0, 1.0, 1.0, 1.0], [0.1] * 4])
    with diag.watch_shadow():
        linear(x).backward(dy)
    row = diag.collect()
    assert not any(m._forward_hooks for m in linear.modules())  # the hooks are gone after the step
    first = "shadow/mxfp4/0/input"
    assert row[f"{first}/rel_err"] == pytest.approx(math.sqrt((1 + 0.2**2) / (49 + 0.2**2 + 30 + 32 * 0.25)))
    assert (row[f"{first}/underflow"], row[f"{first}/saturated"]) == (1 / 64, 1 / 64)
    grad = "shadow/mxfp4/0/grad_output"
    assert row[f"{grad}/rel_err"] == pytest.approx(math.sqrt((1 + 4 * (0.1 - 6 / 64) ** 2) / (28 + 4 * 0.01)))
    assert row[f"{grad}/saturated"] == 4 / 8
    for fmt in ("mxfp4", "nvfp4"):  # each operand as quantize gives it, along its last axis
        for op, t in (("input", x), ("weight", linear.weight), ("grad_output", dy)):
            assert row[f"shadow/{fmt}/0/{op}/rel_err"] == pytest.approx(rel_err(t, fmt), rel=1e-6)
        errors = [row[f"shadow/{fmt}/0/{op}/rel_err"] for op in OPERANDS]
        assert row[f"diag/shadow/{fmt}/rel_err"] == pytest.approx(sum(errors) / 3)
        assert row[f"diag/shadow/{fmt}/rel_err_max"] == max(errors)
    assert not any(key.startswith("quant/") or key.startswith("diag/quant") for key in row)


def test_shadow_sums_over_micro_batches():
    """Two micro-batches add up: the statistics are those of both batches' values together."""
    linear = nn.Linear(16, 8)
    diag = shadowed(nn.Sequential(linear), ["mxfp4"])
    xs = [torch.randn(3, 5, 16, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    with diag.watch_shadow():
        for x in xs:
            linear(x).sum().backward()
    row = diag.collect()
    both = torch.cat([x.reshape(-1, 16) for x in xs])
    assert row["shadow/mxfp4/0/input/rel_err"] == pytest.approx(rel_err(both, "mxfp4"), rel=1e-6)
    assert row["shadow/mxfp4/0/weight/rel_err"] == pytest.approx(rel_err(linear.weight, "mxfp4"), rel=1e-6)


class Attending(nn.Module):
    """An attention core alone, as a GPT's block calls it."""

    def __init__(self):
        super().__init__()
        self.core = ScaledDotProduct()

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return self.core(q, k, v)


def test_shadow_attention_by_hand_on_torchs_fused_attention():
    """Q and K along d, V along the keys, dO along the queries; P and dS, which the fused attention
    does not show, as autograd gives them for the scores S = QK^T."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 32, 32, generator=gen) for _ in range(3))
    dout = torch.randn(2, 2, 32, 32, generator=gen)
    diag = shadowed(Attending(), ["mxfp4"], attention=True)
    with diag.watch_shadow():
        Attending.forward(diag.model, *(t.clone().requires_grad_() for t in (q, k, v))).backward(dout)
    row = diag.collect()
    scores = (q @ k.transpose(-2, -1)).requires_grad_()
    p = causal_softmax(scores, 1 / math.sqrt(32))
    (p @ v).backward(dout)
    hand = {"query": q, "key": k, "value": v.transpose(-2, -1), "probs": p, "grad_output": dout.transpose(-2, -1),
            "grad_scores": scores.grad}  # fmt: skip
    for op, t in hand.items():
        assert row[f"shadow/mxfp4/core/{op}/rel_err"] == pytest.approx(rel_err(t, "mxfp4"), rel=1e-5), op
    assert row["shadow/mxfp4/core/probs/underflow"] > 0  # small weights flushed
    assert not any(m._forward_hooks for m in diag.model.modules())


def test_shadow_attention_on_a_quantized_core_equals_its_own_statistics():
    """A GPT whose cores compute in mxfp4: the shadow of mxfp4 on Q, K, V and dO is what the cores
    record of them (the same tensors, blocked alike); Linear layers log as without the switch."""
    overrides = [*GPT, "precision=mxfp4", "precision.attention.format=mxfp4", "diagnostics=grads",
                 "diagnostics.shadow=[mxfp4]"]  # fmt: skip
    rows = {}
    for on in (False, True):
        c, cfg = build_from(*overrides, f"diagnostics.shadow_attention={on}")
        diag = Diagnostics(cfg.diagnostics, c.model, c.stepper.params)
        tokens = torch.randint(0, 50, (2, 32), generator=torch.Generator().manual_seed(0))
        with diag.watch_quantization(), diag.watch_shadow():
            c.model(tokens).float().square().mean().backward()
        rows[on] = diag.collect()
    row, core = rows[True], "blocks.0.attn.core"
    for op in ("query", "key", "value", "grad_output"):
        for stat in ("rel_err", "underflow", "saturated"):
            assert row[f"shadow/mxfp4/{core}/{op}/{stat}"] == row[f"quant/{core}/{op}/{stat}"], (op, stat)
    assert f"shadow/mxfp4/{core}/grad_scores/rel_err" in row
    linear = {k: v for k, v in row.items() if k.startswith("shadow/") and ".core/" not in k}
    assert linear == {k: v for k, v in rows[False].items() if k.startswith("shadow/")}


def test_shadow_attention_without_shadow_formats_is_a_config_error():
    with pytest.raises(ConfigError, match=r"diagnostics.shadow_attention=true: needs formats in diagnostics.shadow"):
        validate(compose_cfg("diagnostics=grads", "diagnostics.shadow_attention=true"))


def rows_of(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def is_shadow(key: str) -> bool:
    return key.startswith(("shadow/", "diag/shadow/"))


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    (last,) = sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1:]
    return torch.load(last, weights_only=False)["model"]


@pytest.mark.parametrize(
    "precision",
    [
        ["precision=bf16"],
        # a quantized run: its QuantizedLinear layers shadowed too, its stochastic rounding's draws untouched
        ["precision=nvfp4"],
        ["precision=nvfp4", "precision.attention.format=nvfp4"],  # its attention cores' too
    ],
    ids=["bf16", "nvfp4", "nvfp4_attention"],
)
def test_shadow_leaves_every_value_of_the_run_as_it_was(tmp_path, precision):
    steps = ["diagnostics=grads", "diagnostics.every=1", "accum=2", "trainer.max_steps=3", "trainer.log_every=1",
             "trainer.val_every=0", "sched.warmup_steps=1"]  # fmt: skip
    plain, shadow = tmp_path / "plain", tmp_path / "shadow"
    run(compose_cfg(*GPT, *precision, *steps), plain)
    run(compose_cfg(*GPT, *precision, *steps, "diagnostics.shadow=[mxfp4,nvfp4]", "diagnostics.shadow_attention=true"),
        shadow)  # fmt: skip
    before, after = rows_of(plain), rows_of(shadow)
    assert len(before) == len(after) == 3
    drop = ("perf/",)  # times
    for a, b in zip(before, after):
        assert any(is_shadow(key) for key in b) and not any(is_shadow(key) for key in a)
        kept = {k: json.dumps(v) for k, v in b.items() if not is_shadow(k) and not k.startswith(drop)}
        assert {k: json.dumps(v) for k, v in a.items() if not k.startswith(drop)} == kept  # exact values
    weights, shadow_weights = final_weights(plain), final_weights(shadow)
    assert weights.keys() == shadow_weights.keys()
    for name, w in weights.items():
        if torch.is_tensor(w) and w.is_floating_point():
            assert same_bits(w.float(), shadow_weights[name].float()), name
        else:
            assert w == shadow_weights[name] if not torch.is_tensor(w) else torch.equal(w, shadow_weights[name])


def test_a_bf16_run_logs_shadow_statistics_for_every_linear_layer_and_operand(cli):
    overrides = ["precision=bf16", "model.hidden=[32,16]", "diagnostics=grads", "diagnostics.every=2"]
    result = cli.run(*overrides, "diagnostics.shadow=[mxfp4,nvfp4]", "trainer.max_steps=2").check()
    c, _ = build_from(*overrides)
    layers = [name for name, m in c.model.named_modules() if isinstance(m, nn.Linear)]
    assert len(layers) == 3
    rows = result.metrics()
    assert [r["step"] for r in rows if "diag/shadow/mxfp4/rel_err" in r] == [1, 2]  # the diagnostics steps
    for row in rows:
        for fmt in ("mxfp4", "nvfp4"):
            keys = [f"shadow/{fmt}/{layer}/{op}" for layer in layers for op in OPERANDS]
            logged = [k.rpartition("/")[0] for k in row if k.startswith(f"shadow/{fmt}/") and k.endswith("/rel_err")]
            assert logged == keys  # every layer and operand, in model order
            errors = [row[f"{k}/rel_err"] for k in keys]
            assert all(0.01 < e < 0.5 for e in errors)  # E2M1 keeps about 1 significant bit
            assert all(0 <= row[f"{k}/{stat}"] <= 1 for k in keys for stat in ("underflow", "saturated"))
            assert row[f"diag/shadow/{fmt}/rel_err"] == pytest.approx(sum(errors) / len(errors))
        assert not any(k.startswith("quant/") for k in row)  # bf16 quantizes nothing itself


def test_an_unknown_shadow_format_is_a_one_line_config_error():
    known = ", ".join(FORMATS)
    message = f"diagnostics.shadow[1]=nvfp5: no such number format; they are {known}"
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("diagnostics=grads", "diagnostics.shadow=[mxfp4,nvfp5]"))
    assert str(err.value) == message and "\n" not in message
    with pytest.raises(ConfigError, match=r"diagnostics.shadow=\['mxfp4'\]: needs diagnostics.every > 0"):
        validate(compose_cfg("diagnostics.shadow=[mxfp4]"))  # diagnostics=none: never due
    with pytest.raises(ConfigError, match=r"diagnostics.shadow=mxfp4: must be a list of strings"):
        validate(compose_cfg("diagnostics=grads", "diagnostics.shadow=mxfp4"))


def test_a_run_resumes_with_shadow_turned_on(tmp_path, capsys):
    """Shadow changes no value, so a checkpoint resumes with it on (an older one, without the key, too)."""
    steps = ["model.hidden=[16]", "diagnostics=grads", "diagnostics.every=1", "trainer.val_every=0"]
    run(compose_cfg(*steps, "trainer.max_steps=2"), tmp_path)
    run(compose_cfg(*steps, "trainer.max_steps=3", "resume=auto", "diagnostics.shadow=[mxfp4]"), tmp_path)
    assert "diagnostics.shadow: [] -> ['mxfp4'] (allowed)" in capsys.readouterr().err
    last = rows_of(tmp_path)[-1]
    assert last["step"] == 3 and "diag/shadow/mxfp4/rel_err" in last
