"""`halfprec sensitivity`: the numbers on a model small enough to know them by hand, the suggested
rules, and the command as a user runs it (a trained run dir in, files and rules that train out)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from halfprec.components.tasks.classification import Classification
from halfprec.numerics.attention import AttentionRecipe
from halfprec.numerics.formats import BLOCK_SCALED
from halfprec.numerics.policy import PrecisionPolicy
from halfprec.numerics.quantized import Recipe
from halfprec.tools.sensitivity.measure import (
    WHOLE,
    Agreement,
    Measured,
    Row,
    Run,
    SensitivityError,
    measure,
    parse_formats,
    parse_recipe,
)
from halfprec.tools.sensitivity.rules import keep_high, ranked, rules_override

from helpers import TRAIN, compose_cfg, typed_cfg

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def e2m1_values(rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Values of the FP4 element grid, each row holding a 4 or a 6: every 32-value block's E8M0 scale
    is then 1, and MXFP4 keeps each value as it is."""
    signs = torch.where(torch.rand(rows, cols, generator=gen) < 0.5, -1.0, 1.0)
    x = E2M1[torch.randint(0, 8, (rows, cols), generator=gen)] * signs
    x[:, 0] = 4.0
    return x


class Toy(nn.Module):
    """exact: weights and inputs on MXFP4's grid. spiky: its input has a channel of 10^4 (that its
    weights ignore) in every 32-value block, so MXFP4's shared scale flushes the rest to zero. head:
    the output head, which a plan keeps high."""

    def __init__(self, gen: torch.Generator):
        super().__init__()
        self.exact = nn.Linear(32, 32, bias=False)
        self.plain = nn.Linear(32, 32, bias=False)
        self.spiky = nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, 4, bias=False)
        with torch.no_grad():
            self.exact.weight.copy_(e2m1_values(32, 32, gen) / 8)
            for layer in (self.plain, self.spiky, self.head):
                layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) / 4)
            self.spiky.weight[:, 0] = 0.0
        self.register_buffer("offset", torch.zeros(32))
        self.offset[0] = 1e4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.plain(self.exact(x))
        return self.head(torch.tanh(self.spiky(h + self.offset)))


class Batches:
    def __init__(self, batches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.batches = batches

    def val_batches(self, size: int, device: torch.device):
        return iter(self.batches)


def toy_run(model: nn.Module, batches: list) -> Run:
    config = typed_cfg("precision=fp32", "data.batch_size=8", "seed=0")
    policy = PrecisionPolicy.from_config(config.precision, "cpu")
    data = Batches(batches)
    return Run(config, Path("toy.pt"), 0, model.eval(), data, Classification(), policy, torch.device("cpu"))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def toy():
    gen = torch.Generator().manual_seed(0)
    model = Toy(gen)
    inputs = [e2m1_values(8, 32, gen) for _ in range(3)]
    # labels the model predicts: a "trained" model, which a perturbation makes worse
    batches = [(x, model(x).argmax(1).detach()) for x in inputs]
    run = toy_run(model, batches)
    return run, measure(run, ["mxfp4", "mxfp8"], 2, parse_recipe("none", Recipe()), seed=0)


def row(measured, layer, fmt):
    return next(r for r in measured.rows if r.layer == layer and r.format == fmt)


def test_a_layer_the_format_represents_exactly_has_no_damage_and_one_that_overflows_the_most(toy):
    run, measured = toy
    # the reference: the plain model's loss over the first two batches, by hand
    by_hand = sum(float(F.cross_entropy(run.model(x), y).detach()) for x, y in run.data.batches[:2]) / 2
    assert measured.reference_loss == pytest.approx(by_hand, rel=1e-6)
    assert measured.batches == 2
    exact = row(measured, "exact", "mxfp4")
    assert exact.diffs == [0.0, 0.0]  # its forward GEMM's operands are already MXFP4 values
    assert exact.input_grad is None  # its inputs are data: no gradient to pass back
    layers = ["exact", "plain", "spiky", "head"]
    damage = {n: measured.damage(row(measured, n, "mxfp4")) for n in layers}
    assert max(damage, key=damage.get) == "spiky" and damage["spiky"] > 3 * max(damage["plain"], damage["head"])
    # MXFP8 keeps 3 mantissa bits where MXFP4 keeps 1: less damage in the spiky layer, closer gradients
    assert measured.damage(row(measured, "spiky", "mxfp8")) < damage["spiky"]
    plain4, plain8 = row(measured, "plain", "mxfp4"), row(measured, "plain", "mxfp8")
    assert 0 < plain8.weight_grad.rel_err < plain4.weight_grad.rel_err
    assert plain4.weight_grad.cosine < plain8.weight_grad.cosine < 1
    assert plain4.input_grad is not None and plain8.input_grad is not None
    assert 0 < plain8.input_grad.rel_err < plain4.input_grad.rel_err
    # the whole model: every layer but the head, as precision=mxfp4 would plan it
    whole = row(measured, WHOLE, "mxfp4")
    assert whole.params == 3 * 32 * 32 and measured.plans["mxfp4"]["head"] == "high"


def test_measuring_leaves_the_model_as_it_was_and_repeats_exactly(toy):
    run, measured = toy
    assert [type(m) for m in run.model.children()] == [nn.Linear] * 4
    again = measure(run, ["mxfp4", "mxfp8"], 2, parse_recipe("none", Recipe()), seed=0)
    assert [(r.diffs, r.weight_grad) for r in again.rows] == [(r.diffs, r.weight_grad) for r in measured.rows]


def test_agreement_by_hand():
    agree = Agreement()
    agree.add(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert agree.cosine == pytest.approx(1 / math.sqrt(2))
    assert agree.rel_err == pytest.approx(1 / math.sqrt(2))  # |(0, -1)| / |(1, 1)|
    agree.add(torch.tensor([0.0, 2.0]), torch.tensor([0.0, 2.0]))  # sums over batches, then one cosine
    assert agree.cosine == pytest.approx(5 / math.sqrt(5 * 6))
    assert agree.rel_err == pytest.approx(math.sqrt(1 / 6))


def test_the_suggestion_keeps_the_most_damaged_within_the_budget(toy):
    _, measured = toy
    candidates = ranked(measured, "mxfp4")
    assert [r.layer for r in candidates][0] == "spiky" and "head" not in [r.layer for r in candidates]
    every = lambda row: True  # noqa: E731 (the budget alone)
    assert [r.layer for r in keep_high(candidates, 0.34, "layers", every)] == ["spiky"]  # 1.02 layers: one
    assert keep_high(candidates, 0.3, "layers", every) == []  # 0.9 of a layer: none
    assert [r.layer for r in keep_high(candidates, 0.34, "params", every)] == ["spiky"]  # a third of 3 equal layers
    override = rules_override([r.layer for r in keep_high(candidates, 0.7, "layers", every)])
    cfg = compose_cfg("precision=mxfp4", override.strip("'"))
    assert [dict(r) for r in cfg.precision.rules] == [
        {"match": r.layer, "format": "high"} for r in keep_high(candidates, 0.7, "layers", every)
    ]
    # an nn.Sequential's layers are named "1", "3": still strings once Hydra has read the rule
    assert compose_cfg("precision=mxfp4", rules_override(["3"]).strip("'")).precision.rules[0].match == "3"


def test_a_damage_within_twice_its_standard_error_is_noise_and_makes_no_rule():
    """Damages by hand: +0.3 on every batch is certain; +0.2 +- 0.15 (batches 0.05 and 0.35) is not
    beyond 2 standard errors; a single batch has no error, so nothing is significant."""
    sure, noisy, single = Row("a", "f", 10, [0.3, 0.3]), Row("b", "f", 10, [0.05, 0.35]), Row("c", "f", 1, [1.0])
    assert Measured.damage_se(noisy) == pytest.approx(0.15) and Measured.damage(noisy) == pytest.approx(0.2)
    assert [Measured.significant(r) for r in (sure, noisy, single)] == [True, False, False]
    ranked_rows = [noisy, sure]  # noisy ranks first by its mean: it is still passed over
    assert keep_high(ranked_rows, 0.5, "layers", Measured.significant) == [sure]
    assert keep_high(ranked_rows, 1.0, "params", Measured.significant) == [sure]
    assert keep_high([noisy], 1.0, "layers", Measured.significant) == []


def test_bad_arguments_and_a_model_without_linear_layers_are_one_line_errors():
    with pytest.raises(SensitivityError, match=r"--formats: unknown mxfp5; known: fp8_e4m3, "):
        parse_formats("mxfp4,mxfp5")
    with pytest.raises(SensitivityError, match=r"--recipe: unknown sr; use run, none, or stochastic_grads"):
        parse_recipe("sr", Recipe())
    run_recipe = Recipe(stochastic_grads=True, weight_2d=True)
    assert parse_recipe("run", run_recipe).weight_2d and parse_recipe("run", run_recipe).stochastic_grads
    run = toy_run(nn.Sequential(nn.Flatten()), [(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long))])
    with pytest.raises(SensitivityError, match="Sequential has no Linear layer"):
        measure(run, ["mxfp4"], 1, parse_recipe("none", Recipe()), seed=0)
    run = toy_run(nn.Sequential(nn.Flatten(), nn.Linear(4, 2)), [(torch.zeros(1, 4), torch.zeros(1, dtype=torch.long))])
    with pytest.raises(SensitivityError, match="Sequential's only Linear layer, 1, is its output head, which a plan"):
        measure(run, ["mxfp4"], 1, parse_recipe("none", Recipe()), seed=0)


@pytest.mark.parametrize(
    "args, line",
    [
        (["--batches", "0"], "--batches 0: measure at least 1 validation batch"),
        (["--keep", "1.5"], "--keep 1.5: a share between 0 and 1"),
        (["--out", "{file}/sub"], "--out {file}/sub: cannot write there (Not a directory); choose another dir"),
        (["--formats", "mxfp4,int3"], "--formats: unknown int3; known: fp8_e4m3,"),
        pytest.param(
            ["--device", "cuda"],
            "--device cuda: no CUDA GPU is visible here; use --device cpu",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible"),
        ),
    ],
)
def test_each_bad_argument_is_one_line_before_anything_is_measured(args, line, tmp_path, capsys):
    from halfprec.tools.cli import main

    file = tmp_path / "a_file"
    file.write_text("")
    run_dir = tmp_path / "run"
    if "--formats" in args:  # judged once the run is read: a trained run is needed
        assert train(tmp_path, "run", "precision=fp32").returncode == 0
    assert main(["sensitivity", str(run_dir), *[a.format(file=file) for a in args]]) == 2
    (said,) = capsys.readouterr().err.strip().splitlines()
    assert said.startswith(f"halfprec sensitivity: error: {line.format(file=file)}")


GPT = ["task=lm", "model.n_layer=2", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=4"]


PRECISIONS = sorted(p.stem for p in (Path(__file__).parents[1] / "conf" / "precision").glob("*.yaml"))
CRASHED_BEFORE = ("nvfp4", "fp8_block")  # their run's weight_2d reached formats without square blocks


@pytest.mark.parametrize(
    "precision",
    [p if p in CRASHED_BEFORE else pytest.param(p, marks=pytest.mark.slow) for p in PRECISIONS if p != "tf32"],
)  # tf32 is a CUDA mode: a CPU refuses it before training
def test_the_tool_measures_a_run_of_every_precision_option(precision, tmp_path, capsys):
    """A one-step GPT of each precision option, measured with its own recipe in the default formats:
    the run's format first (the suggestion is for it), the block formats after."""
    from halfprec.tools.cli import main
    from halfprec.training.run import run

    emulate = ["precision.fp8_emulate=true"] if precision in ("fp8", "fp8_row") else []  # no fp8 tensor cores here
    cfg = compose_cfg(*GPT, "model.n_layer=1", f"precision={precision}", *emulate, "trainer.max_steps=1",
                      "trainer.val_every=0")  # fmt: skip
    run(cfg, tmp_path)
    assert main(["sensitivity", str(tmp_path), "--batches", "1"]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "sensitivity.json").read_text())
    own = [cfg.precision.format] if cfg.precision.format else []
    assert summary["formats"] == list(dict.fromkeys([*own, *BLOCK_SCALED]))
    assert len(summary["rows"]) == len(summary["formats"]) * (4 + 1 + 1)  # 4 block layers, the head, the whole


def test_a_run_in_a_precision_slow_on_this_cpu_is_measured_with_a_warning(tmp_path, capsys):
    """The tool computes as the run did: fp16 (slow on every CPU) says so at the start, as train.py does."""
    from halfprec.tools.cli import main
    from halfprec.training.run import run

    run(compose_cfg(*GPT, "model.n_layer=1", "precision=fp16", "trainer.max_steps=1", "trainer.val_every=0"), tmp_path)
    capsys.readouterr()
    assert main(["sensitivity", str(tmp_path), "--batches", "1", "--formats", "mxfp8"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: the measurement computes as the run did: precision=fp16 computes in fp16, which torch's CPU kernels "
        "(convolutions above all) run far slower than fp32: exact, so fine for checking numerics; for speed use "
        "precision=fp32 here, or a GPU"
    ]


def run_tool(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    tool = [sys.executable, "-c", "import sys; from halfprec.tools.cli import main; sys.exit(main())"]
    return subprocess.run([*tool, *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def train(tmp_path: Path, name: str, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, str(TRAIN), *GPT, "trainer.max_steps=3", "trainer.val_every=0", "logger=none"]
    return subprocess.run([*args, f"hydra.run.dir={tmp_path / name}", *overrides], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)  # fmt: skip


@pytest.mark.slow  # three trainings and the tool in subprocesses: ~15 s
def test_the_command_measures_a_run_writes_its_files_and_its_rules_train(tmp_path):
    assert train(tmp_path, "run", "precision=bf16").returncode == 0
    result = run_tool("sensitivity", str(tmp_path / "run"), "--formats", "mxfp4,nvfp4", "--batches", "4",
                      "--keep", "0.25", cwd=tmp_path)  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "| (whole model) |" in result.stdout and "| blocks.1.mlp.proj |" in result.stdout
    summary = json.loads((tmp_path / "run" / "sensitivity.json").read_text())
    assert summary["formats"] == ["mxfp4", "nvfp4"] and summary["step"] == 3 and summary["precision"] == "bf16"
    assert len(summary["rows"]) == 2 * (8 + 1 + 1)  # 8 block layers, the head, the whole model
    assert (tmp_path / "run" / "sensitivity.png").stat().st_size > 0
    assert "## Suggested rules" in (tmp_path / "run" / "sensitivity.md").read_text()
    # halfprec report draws the measured run's heatmap, and none for a run that was not measured
    assert run_tool("report", str(tmp_path / "run"), "--out", str(tmp_path / "report"), cwd=tmp_path).returncode == 0
    assert (tmp_path / "report" / "sensitivity_run.png").stat().st_size > 0
    assert "sensitivity_run.png" in (tmp_path / "report" / "report.md").read_text()
    # 2 of the 8 layers, each starred (beyond 2 standard errors over the 4 batches) in the mxfp4 column:
    # the rules line as printed, given to train.py through a shell
    (rules,) = re.findall(r"^\s+('precision\.rules=\[.*\]')$", result.stdout, re.M)
    kept = re.findall(r'match: "([\w.]+)"', rules)
    starred = re.findall(r"^\| ([\w.]+) \| \d+ \| [+-][\d.]+\* \|", result.stdout, re.M)
    assert len(kept) == 2 and set(kept) <= set(starred)
    shell = f"{sys.executable} {TRAIN} {' '.join(GPT)} trainer.max_steps=2 logger=none precision=mxfp4 {rules}"
    trained = subprocess.run(shell, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert trained.returncode == 0, trained.stderr
    assert re.search(r"high\s+3\s", trained.stderr)  # the two kept layers and the head
    (tmp_path / "run" / "sensitivity.json").unlink()
    assert run_tool("report", str(tmp_path / "run"), "--out", str(tmp_path / "again"), cwd=tmp_path).returncode == 0
    assert not list((tmp_path / "again").glob("sensitivity*"))


def test_a_run_without_a_checkpoint_and_a_foreign_file_are_one_line(tmp_path):
    (tmp_path / "empty").mkdir()
    result = run_tool("sensitivity", str(tmp_path / "empty"), cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        f"halfprec sensitivity: error: {tmp_path / 'empty'} holds no checkpoint (checkpoints/step-*.pt): the tool "
        "measures a trained model; a run saves one every trainer.ckpt_every steps and at its end"
    ]
    for job in ("0_seed=0", "1_seed=1"):  # a sweep dir: its jobs are the runs
        (tmp_path / "sweep" / job / "checkpoints").mkdir(parents=True)
        (tmp_path / "sweep" / job / "checkpoints" / "step-00000002.pt").write_text("")
    (tmp_path / "sweep" / "sweep.jsonl").write_text("")
    result = run_tool("sensitivity", str(tmp_path / "sweep"), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"halfprec sensitivity: error: {tmp_path / 'sweep'} is a sweep dir, not a run's: pass one of its job dirs, "
        f"e.g. halfprec sensitivity {tmp_path / 'sweep' / '0_seed=0'} (2 of them have a checkpoint)"
    ]
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    result = run_tool("sensitivity", str(tmp_path / "notes.pt"), cwd=tmp_path)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert result.stderr.startswith(f"halfprec sensitivity: error: {tmp_path / 'notes.pt'}: unreadable checkpoint (")


def test_a_checkpoint_from_an_older_version_is_measured_with_the_keys_it_implies(tmp_path, capsys):
    """tests/data's checkpoint predates task=, precision.kernel and the recipe: the tool rebuilds
    its run as that version ran it (a classification MLP in pure bf16, nothing quantized)."""
    import shutil

    from halfprec.tools.cli import main

    (tmp_path / "checkpoints").mkdir()
    old = Path(__file__).parent / "data" / "checkpoint-80b0cad-bf16_pure_kahan.pt"
    shutil.copy(old, tmp_path / "checkpoints" / "step-00000004.pt")
    assert main(["sensitivity", str(tmp_path), "--batches", "1", "--formats", "mxfp8"]) == 0, capsys.readouterr().err
    summary = json.loads((tmp_path / "sensitivity.json").read_text())
    assert summary["formats"] == ["mxfp8"] and summary["precision"] == "bf16_pure_kahan"


@pytest.fixture(scope="module")
def gpt_run(tmp_path_factory):
    """A one-block GPT trained a few steps in fp32 (with dropout, which a quantized core refuses in
    training: the tool measures in eval mode), measured in mxfp4 without and with --attention."""
    from halfprec.tools.cli import main
    from halfprec.training.run import run

    path = tmp_path_factory.mktemp("gpt")
    run(compose_cfg(*GPT, "model.n_layer=1", "model.dropout=0.1", "precision=fp32", "trainer.max_steps=5",
                    "trainer.val_every=0"), path)  # fmt: skip
    summaries = {}
    for name, flag in (("linear", []), ("attention", ["--attention"])):
        args = ["sensitivity", str(path), "--formats", "mxfp4", "--batches", "2", "--out", str(path / name), *flag]
        assert main(args) == 0
        summaries[name] = json.loads((path / name / "sensitivity.json").read_text())
    return path, summaries


def test_with_attention_the_cores_are_rows_and_the_linear_rows_stay_bit_for_bit(gpt_run, capsys):
    path, summaries = gpt_run
    linear, attention = summaries["linear"], summaries["attention"]
    cores = [r for r in attention["rows"] if r["core"]]
    assert [r["layer"] for r in cores] == ["blocks.0.attn.core"] and not any(r["core"] for r in linear["rows"])
    (core,) = cores
    assert core["params"] == 0 and core["candidate"] and math.isfinite(core["damage"])
    assert core["weight_grad_cos"] is None and core["weight_grad_rel_err"] is None  # no weight
    assert 0 < core["input_grad_rel_err"] < 1 and 0 < core["input_grad_cos"] < 1  # q, k, v's gradients in mxfp4
    # every Linear layer's numbers as the tool gave them without attention, bit for bit
    layers = [r for r in attention["rows"] if not r["core"] and r["layer"] != WHOLE]
    assert layers == [r for r in linear["rows"] if r["layer"] != WHOLE]
    assert attention["reference_loss"] == linear["reference_loss"]
    whole = {name: s["rows"][-1] for name, s in summaries.items()}  # the cores join the whole model's row
    assert whole["attention"]["layer"] == WHOLE and whole["attention"]["damage"] != whole["linear"]["damage"]
    text = (path / "attention" / "sensitivity.md").read_text()
    assert re.search(r"^\| blocks\.0\.attn\.core \| 0 \| [+-][\d.]+\*? \|$", text, re.M)
    assert re.search(r"^\| blocks\.0\.attn\.core \| mxfp4 \| .* \| n/a \| n/a \| [\d.]+ \| [\d.]+ \|$", text, re.M)


def test_the_rules_naming_a_core_say_to_quantize_attention_and_train_so(gpt_run, tmp_path):
    """A core among the suggested rules (its damage certain, by hand): the printed line carries
    precision.attention.format, and train.py takes it; without it, a rule naming only a core is a
    config error."""
    import argparse

    from halfprec.errors import ConfigError
    from halfprec.tools.sensitivity.command import suggestion
    from halfprec.training.run import run

    sure = Row("blocks.0.attn.core", "mxfp4", 0, [0.3, 0.3], weight_grad=None, core=True)
    noise = Row("blocks.0.mlp.fc", "mxfp4", 4096, [0.0, 0.0])
    args = argparse.Namespace(keep=0.5, keep_by="layers")
    said = suggestion("mxfp4", args, Measured(0.0, [sure, noise], {}, 2), [sure, noise])
    (line,) = [s.strip() for s in said if "precision.rules=" in s]
    rules, attention = line.rsplit(" ", 1)
    assert rules == rules_override(["blocks.0.attn.core"]) and attention == "precision.attention.format=mxfp4"
    tiny = [*GPT, "model.n_layer=1", "precision=mxfp4", "trainer.max_steps=1", "trainer.val_every=0"]
    run(compose_cfg(*tiny, rules.strip("'"), attention), tmp_path / "with")  # validates and trains
    with pytest.raises(ConfigError, match="matches only attention cores"):
        run(compose_cfg(*tiny, rules.strip("'")), tmp_path / "without")


def test_attention_on_a_model_without_cores_is_one_line():
    batch = (torch.zeros(1, 4), torch.zeros(1, dtype=torch.long))
    run = toy_run(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), [batch])
    with pytest.raises(SensitivityError, match=r"^--attention: Sequential has no attention core to measure"):
        measure(run, ["mxfp4"], 1, parse_recipe("none", Recipe()), seed=0, attention=AttentionRecipe())


def test_a_run_that_quantized_attention_has_its_cores_measured_unless_told_not_to(tmp_path, capsys):
    from halfprec.tools.cli import main
    from halfprec.training.run import run

    run(compose_cfg(*GPT, "model.n_layer=1", "precision=mxfp8", "precision.attention.format=mxfp8",
                    "trainer.max_steps=1", "trainer.val_every=0"), tmp_path)  # fmt: skip
    for flag, cores in (([], ["blocks.0.attn.core"]), (["--no-attention"], [])):
        assert main(["sensitivity", str(tmp_path), "--batches", "1", "--formats", "mxfp8", *flag]) == 0
        summary = json.loads((tmp_path / "sensitivity.json").read_text())
        assert [r["layer"] for r in summary["rows"] if r["core"]] == cores
    assert "5 Linear layer(s) and 1 attention core(s) x 1 format(s)" in capsys.readouterr().err
