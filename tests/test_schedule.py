"""Precision schedules (numerics/schedule.py) and the gradient-to-noise ratio that can trigger them:
phases begin where they say, change what the layers compute as a recipe would from the start, are
logged and printed, resume exactly across a switch, and their config errors name the key."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

from halfprec.config import validate
from halfprec.config.schema import Phase
from halfprec.errors import ConfigError
from halfprec.numerics import quantized
from halfprec.numerics.quantized import QuantizedLinear, Recipe
from halfprec.numerics.schedule import TRIGGERS, build_schedule
from halfprec.training.diagnostics import grad_noise_row
from halfprec.training.run import run

from helpers import compose_cfg

GPT = ["task=lm", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=4",
       "trainer.val_every=0", "trainer.log_every=1", "logger=none", "trainer.progress=false"]  # fmt: skip
PLAN = {"blocks.0.fc": "mxfp4", "blocks.1.fc": "mxfp4", "head": "high"}


def rows(run_dir) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def values(rows: list[dict]) -> list[dict]:
    """What the run computed: the rows without timings and the precision labels."""
    return [{k: v for k, v in r.items() if not k.startswith(("perf/", "precision/"))} for r in rows]


def test_phases_begin_in_order_each_on_top_of_the_last():
    phases = [Phase("high", ["forward"], from_fraction=0.5), Phase("mxfp8", ["wgrad"], match="blocks.1.*",
              when="grad_noise_below_sqrt3"), Phase("high", from_step=9)]  # fmt: skip
    converted, schedule = build_schedule(PLAN, phases, Recipe(), max_steps=10)
    assert converted == PLAN and [schedule.start(i) for i in range(3)] == [6, None, 9]
    assert [schedule.advance(s) for s in range(1, 10)] == [False] * 5 + [True] + [False] * 3  # 3 waits for 2
    assert schedule.pending_trigger() == TRIGGERS["grad_noise_below_sqrt3"]
    schedule.fire(9)  # the trigger held on step 9's diagnostics: phase 2 begins at 10, and 3 with it
    assert schedule.pending_trigger() is None and schedule.advance(10) and schedule.began == [6, 10, 10]
    assert [schedule.phase_at(s) for s in (5, 6, 9, 10)] == [0, 1, 1, 3]
    assert schedule.labels(1) == {"blocks.0.fc": "high-mxfp4-mxfp4", "blocks.1.fc": "high-mxfp4-mxfp4"}
    assert schedule.labels(2)["blocks.1.fc"] == "high-mxfp4-mxfp8" and schedule.labels(3)["blocks.1.fc"] == "high"


def test_a_phase_can_quantize_a_layer_the_plan_keeps_high():
    """From high to low: the output head is a QuantizedLinear from the start, its GEMMs high until then."""
    converted, schedule = build_schedule(PLAN, [Phase("nvfp4", match="head", from_step=3)], Recipe(), 10)
    assert converted["head"] == "nvfp4" and schedule.labels(0)["head"] == "high"
    assert schedule.labels(1)["head"] == "nvfp4"
    with pytest.raises(ConfigError, match=r"schedule\[0\].match=head: names only layers that are high throughout"):
        build_schedule(PLAN, [Phase("high", match="head", from_step=3)], Recipe(), 10)


def test_a_phase_from_step_one_computes_as_the_recipe_would_from_the_start(tmp_path):
    """precision.schedule=[{from_step: 1, gemms: [forward], format: high}] is recipe.forward=high,
    bit for bit; the rows say the phase and the layers' formats (forward-dgrad-wgrad)."""
    steps = [*GPT, "precision=mxfp4", "trainer.max_steps=4"]
    run(compose_cfg(*steps, "precision.schedule=[{from_step: 1, gemms: [forward], format: high}]"), tmp_path / "a")
    run(compose_cfg(*steps, "precision.recipe.forward=high"), tmp_path / "b")
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert values(a) == values(b)
    assert a[0]["precision/phase"] == 1 and a[0]["precision/layers/high-mxfp4-mxfp4"] == 8
    assert b[0]["precision/layers/high-mxfp4-mxfp4"] == 8 and "precision/phase" not in b[0]


def test_a_switch_is_logged_printed_and_changes_the_values_from_its_step_on(tmp_path, capsys):
    steps = [*GPT, "precision=mxfp4", "trainer.max_steps=6"]
    run(compose_cfg(*steps, "precision.schedule=[{from_fraction: 0.5, format: high}]"), tmp_path / "a")
    run(compose_cfg(*steps), tmp_path / "b")
    a, b = rows(tmp_path / "a"), rows(tmp_path / "b")
    assert values(a)[:3] == values(b)[:3] and a[3]["train/loss"] != b[3]["train/loss"]  # from step 4 on
    assert [r.get("precision/phase") for r in a] == [0, None, None, 1, None, None]
    assert a[3]["precision/layers/high"] == 9  # all 8 quantized layers and the head
    err = capsys.readouterr().err
    assert "schedule: precision phase 1 (from step 4): forward, dgrad, wgrad -> high on 8 layers" in err
    assert "step 4: precision phase 1 (from step 4): forward, dgrad, wgrad -> high on 8 layers" in err


def test_a_resumed_run_switches_where_an_unbroken_one_does_a_trigger_included(tmp_path, monkeypatch):
    """Phase 1 from step 3; phase 2 on the trigger (its threshold raised so that it holds at the next
    diagnostics step, 4): it begins at 5. A run stopped at step 4 (its checkpoint between the trigger
    and the switch) and resumed logs the rows of the unbroken run."""
    monkeypatch.setitem(TRIGGERS, "grad_noise_below_sqrt3", ("diag/grad_noise", 1e9))
    schedule = "precision.schedule=[{from_step: 3, gemms: [forward], format: high}, {when: grad_noise_below_sqrt3, gemms: [dgrad], format: mxfp8}]"  # noqa: E501
    steps = [*GPT, "precision=mxfp4", schedule, "diagnostics=grads", "diagnostics.every=2", "sched.total_steps=8"]
    run(compose_cfg(*steps, "trainer.max_steps=8"), tmp_path / "straight")
    run(compose_cfg(*steps, "trainer.max_steps=4"), tmp_path / "resumed")
    run(compose_cfg(*steps, "trainer.max_steps=8", "resume=auto"), tmp_path / "resumed")
    a, b = rows(tmp_path / "straight"), rows(tmp_path / "resumed")
    assert [r.get("precision/phase") for r in a] == [0, None, 1, None, 2, None, None, None]
    assert a[4]["precision/layers/high-mxfp8-mxfp4"] == 8
    # (the stopped run validated at its last step, 4: its val/ keys are that row's only difference)
    assert [{k: v for k, v in r.items() if not k.startswith(("perf/", "val/"))} for r in b] == [
        {k: v for k, v in r.items() if not k.startswith(("perf/", "val/"))} for r in a
    ]
    assert math.isfinite(a[-1]["train/loss"])


def test_the_gradient_to_noise_ratio_is_the_exact_weight_gradient_over_its_quantization_noise(monkeypatch):
    """On a layer small enough to check by hand: ||dy^T x|| / ||dW_quantized - dy^T x||, summed over
    two micro-batches before the norms; none where the weight-gradient GEMM is high."""
    monkeypatch.setattr(quantized, "cpu_bf16", lambda: False)  # the products below are fp32 GEMMs
    torch.manual_seed(0)
    layer = QuantizedLinear.from_linear(nn.Linear(32, 16, bias=False), "mxfp4", Recipe(), seed=1)
    layer.stats = {}
    xs, dys = [torch.randn(8, 32) for _ in range(2)], [torch.randn(8, 16) for _ in range(2)]
    for x, dy in zip(xs, dys):
        layer(x).backward(dy)
    exact = sum(dy.T @ x for x, dy in zip(xs, dys))
    noise = layer.weight.grad - exact
    row = grad_noise_row(["fc"], [layer.stats["wgrad_exact"].square().sum().item(),
                                  layer.stats["wgrad_noise"].square().sum().item()])  # fmt: skip
    assert row["grad_noise/fc"] == pytest.approx(float(exact.norm() / noise.norm()), rel=1e-5)
    assert row["diag/grad_noise"] == row["grad_noise/fc"] and 1 < row["diag/grad_noise"] < 100
    high = QuantizedLinear.from_linear(nn.Linear(32, 16, bias=False), "mxfp4", Recipe(wgrad="high"), seed=1)
    high.stats = {}
    high(xs[0]).backward(dys[0])
    assert "wgrad_noise" not in high.stats


def test_a_run_logs_the_ratio_per_layer_and_over_the_model(tmp_path):
    run(compose_cfg(*GPT, "precision=mxfp4", "trainer.max_steps=2", "diagnostics=grads"), tmp_path)
    first = rows(tmp_path)[0]
    ratios = {k: v for k, v in first.items() if k.startswith("grad_noise/")}
    assert len(ratios) == 8 and min(ratios.values()) <= first["diag/grad_noise"] <= max(ratios.values())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["precision.schedule=[{format: high}]"], r"precision.schedule\[0\]=.*a phase is \{format"),
        (["precision.schedule=[{from_step: 2, from_fraction: 0.5, format: high}]"], "a phase is"),
        (["precision.schedule=[{from_step: 2, format: mxfp9}]"], r"schedule\[0\].format=mxfp9: a format \(fp8_e4m3"),
        (["precision.schedule=[{from_step: 2, format: high, gemms: [bwd]}]"], r"schedule\[0\].gemms=\['bwd'\]"),
        (["precision.schedule=[{from_fraction: 1.5, format: high}]"], r"from_fraction=1.5: must be"),
        (["precision.schedule=[{when: grad_noise_below_sqrt3, format: high}]"], "reads the diagnostics rows: add diag"),
        (
            ["precision.schedule=[{from_step: 5, format: high}, {from_step: 2, format: mxfp8}]"],
            r"schedule\[1\].from_step=2: begins at step 2, before the phase above it \(step 5\)",
        ),
        (["precision=fp8", "precision.schedule=[{from_step: 2, format: high}]"], "float8 kernel has no precision.sch"),
    ],
)
def test_schedule_config_errors_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(*GPT, "precision=mxfp4", *overrides))


def test_a_phase_matching_no_layer_names_them(tmp_path):
    with pytest.raises(ConfigError, match=r"precision.schedule\[0\].match=mlp.x: matches no Linear layer; they are"):
        run(compose_cfg(*GPT, "precision=mxfp4", "precision.schedule=[{from_step: 2, format: high, match: mlp.x}]"),
            tmp_path)  # fmt: skip
    with pytest.raises(ConfigError, match=r"schedule\[0\].match=null: has no layers: precision.format quantizes"):
        run(compose_cfg(*GPT, "precision=bf16", "precision.schedule=[{from_step: 2, format: mxfp4}]"), tmp_path / "b")


def test_the_schema_and_the_schedule_know_the_same_triggers():
    from typing import get_args, get_type_hints

    hint = get_type_hints(Phase, include_extras=True)["when"]
    literal = next(a for a in get_args(get_args(hint)[0]) if a is not type(None))
    assert set(get_args(literal)) == set(TRIGGERS)
