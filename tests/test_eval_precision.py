"""Evaluation precision (precision.eval, `halfprec evaluate`): validation in high precision and in
formats beside the training precision's, without changing anything the training computes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import read_jsonl
from test_resume import without_perf

from halfprec.config import validate
from halfprec.errors import ConfigError
from halfprec.numerics.attention import QuantizedAttention, ScaledDotProduct
from halfprec.numerics.evaluation import eval_plan, eval_precisions, layers_in
from halfprec.numerics.quantized import QuantizedLinear
from halfprec.training.checkpoint import checkpoint_files, load_checkpoint
from halfprec.training.metrics import evaluate_in
from halfprec.training.run import run

from helpers import build_from, compose_cfg

# A GPT small enough for a test, on a hundredth of the corpus for validation.
TINY = ["task=lm", "model.n_layer=2", "model.n_embd=16", "model.n_head=2", "model.block_size=16",
        "data.batch_size=4", "data.val_fraction=0.01", "trainer.max_steps=4", "trainer.val_every=2",
        "trainer.log_every=1", "trainer.ckpt_every=4"]  # fmt: skip
EVAL = "precision.eval=[high,mxfp4,nvfp4]"


def trained_state(run_dir) -> dict:
    """The last checkpoint's states of what trains (the loop's logged values aside), as saved."""
    ckpt = load_checkpoint(checkpoint_files(run_dir / "checkpoints")[-1])
    return {k: ckpt[k] for k in ("step", "model", "params", "optimizer", "scheduler", "scaler", "rng", "data")}


def same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, list | tuple):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.slow
def test_evaluating_in_other_precisions_changes_no_training_row(tmp_path):
    """nvfp4 (stochastic gradients drawn per backward pass, a Hadamard) with diagnostics' statistics:
    the rows with precision.eval are those without it, bit for bit, plus the new keys; so are the
    weights, the optimizer, the layers' backward-pass counters and the generators at the end. The
    training format evaluated after training is the training precision's validation itself."""
    overrides = [*TINY, "precision=nvfp4", "diagnostics=grads", "diagnostics.every=2"]
    run(compose_cfg(*overrides), tmp_path / "plain")
    run(compose_cfg(*overrides, EVAL), tmp_path / "eval")
    plain, evaluated = (read_jsonl(tmp_path / d / "metrics.jsonl") for d in ("plain", "eval"))
    added = [{k: v for k, v in r.items() if "@" in k} for r in evaluated]
    assert without_perf([{k: v for k, v in r.items() if "@" not in k} for r in evaluated]) == without_perf(plain)
    assert [sorted(a) for a in added if a] == [sorted(f"{m}@{e}" for e in ("high", "mxfp4", "nvfp4")
                                                      for m in ("val/loss", "val/ppl", "val/bpb"))] * 2  # fmt: skip
    assert same(trained_state(tmp_path / "plain"), trained_state(tmp_path / "eval"))
    last = evaluated[-1]
    assert last["val/loss@nvfp4"] == last["val/loss"]  # its forward, post-training, is the training's
    assert last["val/loss@high"] != last["val/loss"] and last["val/loss@mxfp4"] != last["val/loss"]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["val/loss@mxfp4"] == last["val/loss@mxfp4"]


def test_an_evaluation_leaves_the_modules_their_modes_and_the_generators_as_they_were():
    c, _ = build_from(*TINY, "precision=mxfp8", "precision.recipe.stochastic_grads=true", EVAL)
    policy, model = c.stepper.policy, c.model
    before = dict(model.named_modules())
    counters = {n: m.backward_passes for n, m in before.items() if isinstance(m, QuantizedLinear)}
    model.train()
    cpu_rng = torch.get_rng_state()
    got = {}
    for precision in policy.evals:
        got |= evaluate_in(precision, model, c.data, c.stepper.task, policy, 4, c.device)
        with layers_in(model, precision):  # inside: the evaluation's layers
            layer = model.get_submodule("blocks.0.mlp.fc")
            assert isinstance(layer, QuantizedLinear) == (precision.entry != "high")
            assert layer.weight is before["blocks.0.mlp.fc"].weight
    after = dict(model.named_modules())
    assert after.keys() == before.keys() and all(after[n] is before[n] for n in before)
    assert {n: m.backward_passes for n, m in after.items() if isinstance(m, QuantizedLinear)} == counters
    assert all(m.stats is None for m in after.values() if isinstance(m, QuantizedLinear))
    assert torch.equal(torch.get_rng_state(), cpu_rng)
    assert all(m.training for m in after.values())
    assert sorted(got) == sorted(f"val/{m}@{e}" for e in ("high", "mxfp4", "nvfp4") for m in ("loss", "ppl", "bpb"))


def test_the_plan_follows_the_rules_and_high_blocks_and_keeps_the_head_high():
    c, _ = build_from(*TINY, "precision=bf16")
    rules = [type("R", (), {"match": "blocks.0.attn.*", "format": "high"})(),
             type("R", (), {"match": "blocks.1.mlp.fc", "format": "mxfp8"})()]  # fmt: skip
    plan = eval_plan(c.model, "nvfp4", rules)
    assert plan["blocks.0.attn.qkv"] == plan["blocks.0.attn.proj"] == "high"
    assert plan["blocks.1.mlp.fc"] == plan["blocks.0.mlp.fc"] == "nvfp4"  # a rule's format: quantized, in the entry's
    assert plan["lm_head"] == "high"
    assert set(eval_plan(c.model, "mxfp4", [], high_last=1)) == set(plan)
    assert {n for n, f in eval_plan(c.model, "mxfp4", [], high_last=1).items() if f != "high"} == {
        "blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc", "blocks.0.mlp.proj"}  # fmt: skip
    assert set(eval_plan(c.model, "high", rules).values()) == {"high"}
    with pytest.raises(ConfigError, match=r"^precision.eval=mxfp4: quantizes no Linear layer of GPT"):
        eval_plan(c.model, "mxfp4", [], high_first=1, high_last=1)


def test_a_run_with_quantized_attention_evaluates_its_cores_in_each_entry_and_gets_them_back():
    """precision.attention on: high is torch's fused attention in every core, a format quantizes the
    cores the rules leave quantized (a rule naming a core alone is valid), and the very modules return."""
    rule = "precision.rules=[{match: blocks.1.attn.core, format: high}]"
    c, _ = build_from(*TINY, "precision=bf16", "precision.attention.format=mxfp8", rule)
    cores = {n: c.model.get_submodule(n) for n in ("blocks.0.attn.core", "blocks.1.attn.core")}
    assert (
        type(cores["blocks.0.attn.core"]) is QuantizedAttention
        and type(cores["blocks.1.attn.core"]) is not QuantizedAttention
    )
    p = c.stepper.policy.config
    high, mxfp4 = eval_precisions(c.model, ["high", "mxfp4"], p.recipe, p.rules, attention=p.attention)
    with layers_in(c.model, high):
        assert all(type(c.model.get_submodule(n)) is ScaledDotProduct for n in cores)
    with layers_in(c.model, mxfp4):
        inside = {n: c.model.get_submodule(n) for n in cores}
        assert (
            type(inside["blocks.0.attn.core"]) is QuantizedAttention and inside["blocks.0.attn.core"].format == "mxfp4"
        )
        assert type(inside["blocks.1.attn.core"]) is ScaledDotProduct
    assert all(c.model.get_submodule(n) is m for n, m in cores.items())


@pytest.mark.parametrize(
    "overrides,line",
    [
        (["precision.eval=[high,mxfp5]"], "precision.eval=mxfp5: a list of high and formats, e.g. [high, mxfp4, "),
        (["precision.eval=[mxfp4,mxfp4]"], "precision.eval=mxfp4: a list of high and formats once each, e.g. "),
        (["trainer=fsdp", EVAL], "precision.eval=['high', 'mxfp4', 'nvfp4']: is not supported with trainer=fsdp"),
    ],
)
def test_a_bad_evaluation_precision_is_one_line_naming_precision_eval(overrides, line):
    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(*TINY, *overrides))
    assert str(info.value).startswith(line) and "\n" not in str(info.value)


def test_precision_eval_is_accepted_with_the_native_kernel():
    validate(compose_cfg(*TINY, "precision=fp8", "precision.fp8_emulate=true", EVAL))


@pytest.mark.slow
def test_halfprec_evaluate_prints_and_writes_a_finished_runs_metrics_per_precision(tmp_path):
    """A run trained in bf16 with precision.eval; the command on its checkpoint gives what its last
    validation logged, and says a bad argument in one line."""
    run(compose_cfg(*TINY, "precision=bf16", EVAL), tmp_path)
    last = read_jsonl(tmp_path / "metrics.jsonl")[-1]
    cmd = [sys.executable, "-m", "halfprec.tools.cli", "evaluate", str(tmp_path)]
    done = subprocess.run([*cmd, "--eval", "high,mxfp4,nvfp4"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| precision | quantized_layers | val/loss | val/ppl | val/bpb |" in done.stdout
    rows = json.loads((tmp_path / "evaluate.json").read_text())["rows"]
    assert [r["precision"] for r in rows] == ["high", "mxfp4", "nvfp4"]
    for r in rows:
        assert r["val/loss"] == pytest.approx(last[f"val/loss@{r['precision']}"], rel=1e-6)
    assert rows[0]["val/loss"] == pytest.approx(last["val/loss"], rel=1e-6)
    assert (tmp_path / "evaluate.csv").read_text().splitlines()[
        0
    ] == "precision,quantized_layers,val/loss,val/ppl,val/bpb"
    ruled = subprocess.run([*cmd, "--eval", "mxfp4", "--rules", "blocks.*=high", "--out", str(tmp_path / "r")],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
    assert ruled.returncode == 2
    assert ruled.stderr.strip().startswith("halfprec evaluate: error: --eval=mxfp4: quantizes no Linear layer")
    bad = subprocess.run([*cmd, "--eval", "high,mxfp5"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "unknown mxfp5" in bad.stderr
