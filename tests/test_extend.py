"""Extending a fork: the extensions docs/guide/extending.md promises, each made in a temporary copy of
the repository and trained there from the command line (docs/design.md, "Layers")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

# A precision option made of settings that exist: no code change.
MY_PRECISION = """# pure bf16 weights with Kahan-compensated updates and norms in bf16 too
defaults: [bf16_pure]
name: bf16_kahan_all
update: kahan
keep_norm_fp32: false
"""

# A model: one file in components/models/ (registered when the package is imported) and a YAML.
MY_MODEL = '''"""A CNN of two convolutions, for the test that a model is one file plus a YAML."""

from __future__ import annotations

from typing import Annotated

from torch import nn

from halfprec.components.models import register_model
from halfprec.spec import Spec


@register_model("tiny_cnn")
def create_tiny_cnn(
    input_shape: tuple[int, ...], num_classes: int, channels: Annotated[int, Spec(low=1, doc="conv channels")] = 4
) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(input_shape[0], channels, 3, padding=1), nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(channels, num_classes),
    )  # fmt: skip
'''


@pytest.fixture(scope="module")
def fork(tmp_path_factory) -> Path:
    """A copy of the repository's tracked (and not ignored) files, as a fork starts."""
    root = tmp_path_factory.mktemp("fork")
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    )
    for name in filter(None, listed.stdout.decode().split("\0")):
        source = REPO / name
        if source.is_file():
            (root / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, root / name)
    return root


def train(fork: Path, *overrides: str, multirun: bool = False) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(fork / "src"), "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(fork / "train.py"), *(["-m"] if multirun else [])]
    args += ["logger=none", "trainer.progress=false", "trainer.max_steps=5"]
    return subprocess.run([*args, *overrides], cwd=fork, env=env, capture_output=True, text=True, timeout=300)


def test_a_precision_option_is_a_yaml_file_alone(fork):
    (fork / "conf" / "precision" / "bf16_kahan_all.yaml").write_text(MY_PRECISION)
    result = train(fork, "precision=bf16_kahan_all", "hydra.run.dir=runs/precision")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((fork / "runs" / "precision" / "summary.json").read_text())
    assert (summary["precision/compute_dtype"], summary["precision/param_dtype"]) == ("bfloat16", "bfloat16")
    assert summary["status"] == "completed"


def test_a_model_is_one_file_plus_a_yaml(fork):
    (fork / "src" / "halfprec" / "components" / "models" / "tiny_cnn.py").write_text(MY_MODEL)
    (fork / "conf" / "model" / "tiny_cnn.yaml").write_text("# two convolutions\narch: tiny_cnn\nchannels: 4\n")
    result = train(fork, "model=tiny_cnn", "model.channels=6", "hydra.run.dir=runs/model")
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((fork / "runs" / "model" / "summary.json").read_text())["status"] == "completed"
    # its annotated argument is checked like any config key
    bad = train(fork, "model=tiny_cnn", "model.channels=0", "hydra.run.dir=runs/bad")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: model.channels=0: must be an integer >= 1 (conv channels)"


# A dataset: one file in components/data/ (registered when the package is imported) and a YAML.
MY_DATASET = '''"""Stripes: which row of a 4x4 image is lit, for the test that a dataset is one file plus a YAML."""

from __future__ import annotations

from typing import Annotated

import torch
import torch.nn.functional as F

from halfprec.components.data import Dataset, Split, register_dataset
from halfprec.spec import Spec


@register_dataset("stripes")
def load_stripes(
    num_train: Annotated[int, Spec(low=1, doc="training samples")] = 256,
    noise: Annotated[float, Spec(low=0, doc="the std of the noise on every pixel")] = 0.1,
    seed: Annotated[int, Spec(low=0, doc="the samples' seed")] = 0,
) -> Dataset:
    g = torch.Generator().manual_seed(seed)

    def split(n: int) -> Split:
        y = torch.randint(0, 4, (n,), generator=g)
        rows = F.one_hot(y, 4).float().view(n, 1, 4, 1).expand(n, 1, 4, 4)
        return Split(rows + noise * torch.randn(n, 1, 4, 4, generator=g), y)

    return Dataset(split(num_train), split(64), (1, 4, 4), 4)
'''


def test_a_dataset_is_one_file_plus_a_yaml(fork):
    (fork / "src" / "halfprec" / "components" / "data" / "stripes.py").write_text(MY_DATASET)
    yaml = "# which row of a 4x4 image is lit\nname: stripes\nbatch_size: 32\nnum_train: 256\nnoise: 0.1\nseed: 0\n"
    (fork / "conf" / "data" / "stripes.yaml").write_text(yaml)
    result = train(fork, "data=stripes", "data.num_train=128", "hydra.run.dir=runs/data")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((fork / "runs" / "data" / "summary.json").read_text())
    assert summary["status"] == "completed" and 0 <= summary["val/acc"] <= 1  # the mlp was built for 1x4x4, 4 classes
    # its annotated argument is checked like any config key
    bad = train(fork, "data=stripes", "data.num_train=0", "hydra.run.dir=runs/bad_data")
    assert bad.returncode == 2
    assert bad.stderr.strip() == "error: data.num_train=0: must be an integer >= 1 (training samples)"


# A recipe switch: a field of numerics/quantized.py's Recipe (its type, doc and off value), what it
# does there, and its line in conf/precision/fp32.yaml's recipe block. Here: the input-gradient GEMM
# on fp32 operands (recipe.dgrad=high rounds them to the compute dtype first).
SWITCH_FIELD = (
    '    weight_2d: Annotated[bool, Spec(doc="square weight blocks (nvfp4 16x16, fp8_block 128x128)")] = False\n',
    '    fp32_dgrad: Annotated[bool, Spec(doc="the input-gradient GEMM on fp32 operands")] = False\n',
)
SWITCH_BEHAVIOUR = """            dx = gemm(dyq, wq, layer.accumulate["dgrad"]).to(ctx.x_dtype).reshape(ctx.shape)
"""
SWITCH_YAML = "  scale_rule: floor "


def add_after(path: Path, anchor: str, text: str) -> None:
    source = path.read_text()
    assert source.count(anchor) == 1, f"{anchor!r} moved in {path}: update this test's anchors"
    path.write_text(source.replace(anchor, anchor + text))


@pytest.mark.slow  # ~25 s: two runs and three config errors in the copy
def test_a_recipe_switch_is_a_field_and_a_yaml_line(fork):
    quantized = fork / "src" / "halfprec" / "numerics" / "quantized.py"
    add_after(quantized, SWITCH_FIELD[0], SWITCH_FIELD[1])
    high = "            if layer.recipe.fp32_dgrad:\n"
    high += "                dx = (dy.float() @ weight.float()).to(ctx.x_dtype).reshape(ctx.shape)\n"
    high += "            else:\n" + "".join("    " + line + "\n" for line in SWITCH_BEHAVIOUR.splitlines())
    source = quantized.read_text()
    assert source.count(SWITCH_BEHAVIOUR) == 1, "QuantizedMatmul.backward's dx moved: update this test's anchor"
    quantized.write_text(source.replace(SWITCH_BEHAVIOUR, high))
    yaml = fork / "conf" / "precision" / "fp32.yaml"
    line = next(line for line in yaml.read_text().splitlines() if line.startswith(SWITCH_YAML))
    add_after(yaml, line + "\n", "  fp32_dgrad: false     # the input-gradient GEMM on fp32 operands\n")

    common = ["precision=mxfp4", "model.hidden=[64,64]", "trainer.val_every=0"]
    losses = []
    for on in ("false", "true"):
        result = train(fork, *common, f"precision.recipe.fp32_dgrad={on}", f"hydra.run.dir=runs/switch_{on}")
        assert result.returncode == 0, result.stderr[-3000:]
        losses.append(json.loads((fork / "runs" / f"switch_{on}" / "summary.json").read_text())["train/loss"])
    assert losses[0] != losses[1]  # fc1's input gradient came through an fp32 GEMM
    errors = {  # checked as every recipe key is, by the seam's converters as every switch is
        "precision.recipe.fp32_dgrad=3": "error: precision.recipe.fp32_dgrad=3: ",
        "precision=bf16 precision.recipe.fp32_dgrad=true": "applies to precision.format's layers; no layer",
        "precision=fp8 precision.recipe.fp32_dgrad=true": "torchao's float8 kernel has no precision.recipe.fp32_dgrad",
    }
    for overrides, needle in errors.items():
        bad = train(fork, *common, *overrides.split(), "hydra.run.dir=runs/bad")
        assert bad.returncode == 2 and needle in bad.stderr, bad.stderr[-3000:]


# A task: one file in components/tasks/ (registered when the package is imported) and a YAML. Its
# metrics are the one list the objective, sweep.jsonl and the report's columns read.
MY_TASK = '''"""The digit's value as a number: the expected class under the softmax, squared error against the label."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from halfprec.components.data import Dataset
from halfprec.components.data.batches import IGNORE_LABEL
from halfprec.components.tasks import Evaluator, Metric, Task, register_task


def value(output: torch.Tensor) -> torch.Tensor:
    classes = torch.arange(output.shape[-1], device=output.device, dtype=torch.float32)
    return output.float().softmax(-1) @ classes


class SquaredError(Evaluator):
    def __init__(self, device: torch.device):
        self.total = torch.zeros((), device=device, dtype=torch.float64)

    def add(self, output: torch.Tensor, targets: torch.Tensor) -> None:
        kept = targets != IGNORE_LABEL
        self.total += ((value(output) - targets.float())[kept] ** 2).sum()

    def sums(self) -> torch.Tensor:
        return self.total.reshape(1)

    def metrics(self, sums: list[float], n: int) -> dict[str, float]:
        return {"val/loss": sums[0] / n, "val/mse": sums[0] / n}


@register_task
class DigitValue(Task):
    name = "digit_value"
    metrics = (Metric("val/loss"), Metric("val/mse"))
    objective = "val/mse"

    def loss(self, output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(value(output), targets.float())

    def evaluator(self, device: torch.device, data: Dataset) -> Evaluator:
        return SquaredError(device)
'''


@pytest.mark.slow  # ~10 s: a two-job sweep and a report in the copy
def test_a_task_is_one_file_plus_a_yaml_and_its_metrics_reach_sweeps_and_reports(fork):
    (fork / "src" / "halfprec" / "components" / "tasks" / "digit_value.py").write_text(MY_TASK)
    (fork / "conf" / "task" / "digit_value.yaml").write_text("# the digit's value as a number\nname: digit_value\n")
    result = train(fork, "task=digit_value", "seed=0,1", "hydra.sweep.dir=runs/task", multirun=True)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [json.loads(line) for line in (fork / "runs" / "task" / "sweep.jsonl").read_text().splitlines()]
    assert [line["status"] for line in lines] == ["completed", "completed"]
    assert all(0 <= line["val/mse"] < 10 for line in lines)  # recorded, as the task's own metric
    # objective=null is the task's val/mse; a name the task does not report is refused with its list
    assert train(fork, "task=digit_value", "objective=val/mse", "hydra.run.dir=runs/mse").returncode == 0
    bad = train(fork, "task=digit_value", "objective=val/acc", "hydra.run.dir=runs/acc")
    assert bad.stderr.strip() == (
        "error: objective=val/acc: task=digit_value reports val/loss, val/mse and train/loss (null: val/mse)"
    )
    env = {**os.environ, "PYTHONPATH": str(fork / "src")}
    report = subprocess.run([sys.executable, "-m", "halfprec.tools.cli", "report", str(fork / "runs" / "task")],
                            env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert report.returncode == 0, report.stderr[-3000:]
    header = next(line for line in report.stdout.splitlines() if line.startswith("| job"))
    assert "| val/mse |" in header and "val/acc" not in header


def test_a_task_and_a_dataset_that_do_not_fit_are_one_line(fork):
    """A regression task on real-valued targets, with data=digits (class labels): a config error
    naming both, not a dtype error deep in the first step."""
    task = MY_TASK.replace('name = "digit_value"', 'name = "regression"\n    learns_from = "values"')
    (fork / "src" / "halfprec" / "components" / "tasks" / "regression.py").write_text(task.replace("DigitValue", "R"))
    (fork / "conf" / "task" / "regression.yaml").write_text("# real-valued targets\nname: regression\n")
    bad = train(fork, "task=regression", "data=digits", "hydra.run.dir=runs/regression")
    assert bad.returncode == 2, bad.stderr[-3000:]
    (line,) = bad.stderr.strip().splitlines()
    assert line.startswith(
        "error: data=digits: gives class labels and task=regression learns from values: no registered dataset "
        "gives them, or task=classification"
    )


# An optimizer: a class anywhere importable (here a module in numerics/) and a YAML with the keys
# every optim config has (config/schema.py, Optim) beside the class's own arguments.
MY_OPTIMIZER = '''"""Lion (Chen et al. 2023): one momentum buffer per parameter, a sign update."""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-4, betas: tuple[float, float] = (0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=betas, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                momentum = self.state[p].setdefault("momentum", torch.zeros_like(p))
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(momentum.lerp(p.grad, 1 - beta1).sign_(), alpha=-group["lr"])
                momentum.lerp_(p.grad, 1 - beta2)
'''

MY_OPTIMIZER_YAML = """# Lion: sign updates, one momentum buffer per parameter (src/halfprec/numerics/lion.py)
_target_: halfprec.numerics.lion.Lion
lr: 0.0001
betas: [0.9, 0.99]
weight_decay: 0.1
clip_grad_norm: null
no_decay: [low_dim]
state_dtype: float32
state_rounding: nearest
"""


def test_an_optimizer_is_a_class_plus_a_yaml_and_its_memory_is_measured(fork, tmp_path):
    (fork / "src" / "halfprec" / "numerics" / "lion.py").write_text(MY_OPTIMIZER)
    (fork / "conf" / "optim" / "lion.yaml").write_text(MY_OPTIMIZER_YAML)
    # The memory benchmark has no rule for Lion: estimate_memory measures its state after one step.
    # Pure bf16: the state is that of the fp32 upcasts the optimizer steps, one fp32 momentum each.
    # It runs beside the training run: each is mostly an interpreter importing torch.
    out = tmp_path / "memory.json"
    env = {**os.environ, "PYTHONPATH": str(fork / "src"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(fork / "benchmarks" / "memory.py"), "--device", "cpu", "--models", "mlp-small"]
    cmd += ["--precisions", "bf16_pure", "--override", "optim=lion", "--steps", "2", "--json", str(out)]
    # Under task=lm it trains with its own values: the task's are AdamW's (conf/task_optim/lm_adamw.yaml)
    tiny_gpt = ["task=lm", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16"]
    with subprocess.Popen(cmd, cwd=fork, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as bench:
        result = train(fork, "optim=lion", *tiny_gpt, "hydra.run.dir=runs/optim")
        _, bench_err = bench.communicate(timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads((fork / "runs" / "optim" / "summary.json").read_text())["status"] == "completed"
    assert "optim: Lion lr=0.0001 betas=[0.9, 0.99] weight_decay=0.1" in result.stderr.splitlines()
    assert bench.returncode == 0, bench_err[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["per_param"]["optimizer_state"] == 4  # bytes per parameter


# A number format: one line in the registry, from an element that exists (MX's E2M1 in 16-value blocks).
MY_FORMAT = '        Format("mxfp4_b16", E["e2m1"], 16, "e8m0"),  # MXFP4 in NVFP4-sized blocks\n'
FORMAT_ANCHOR = '        Format("mxfp4", E["e2m1"], 32, "e8m0"),\n'


@pytest.mark.slow  # ~15 s: a run in the new format and a config error in the copy
def test_a_number_format_is_one_line_in_the_registry(fork):
    add_after(fork / "src" / "halfprec" / "numerics" / "formats" / "__init__.py", FORMAT_ANCHOR, MY_FORMAT)
    common = ["precision=mxfp4", "model.hidden=[64,64]", "trainer.val_every=0"]
    result = train(fork, *common, "precision.format=mxfp4_b16", "hydra.run.dir=runs/format")
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((fork / "runs" / "format" / "summary.json").read_text())
    assert summary["status"] == "completed"
    rows = [json.loads(line) for line in (fork / "runs" / "format" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["precision/layers/mxfp4_b16"] == 2  # the two hidden layers; the head stays high
    bad = train(fork, *common, "precision.format=mxfp4_b17", "hydra.run.dir=runs/bad_format")
    assert bad.returncode == 2 and "mxfp4_b16" in bad.stderr, bad.stderr[-3000:]  # listed among the formats


# A logger: one file in loggers/ (registered when the package is imported) and a YAML with its keys.
MY_LOGGER = '''"""Every n-th row's train/loss as a line of text, for the test that a logger is one file plus a YAML."""

from __future__ import annotations

from typing import Annotated, Any

from halfprec.loggers import RunInfo, register_logger
from halfprec.spec import Spec


@register_logger("lines", "Lines", package="json", install="(part of Python)")
class LinesSink:
    def __init__(self, run: RunInfo, *, every: Annotated[int, Spec(low=1, doc="keep every n-th row")] = 1):
        self.file = open(run.dir / "lines.txt", "a", encoding="utf-8")
        self.every, self.seen = every, 0

    def log(self, row: dict[str, Any]) -> None:
        self.seen += 1
        if "train/loss" in row and self.seen % self.every == 0:
            self.file.write(f"{row['step']} {row['train/loss']}\\n")

    def finish(self, summary: dict[str, Any]) -> None:
        self.file.write(f"end {summary['status']}\\n")
        self.file.close()

    def abandon(self) -> None:
        self.file.close()

    def state(self) -> dict[str, Any]:
        return {}
'''
MY_LOGGER_YAML = "# every n-th row's train/loss in <run dir>/lines.txt\nlines:\n  every: 1\n"


@pytest.mark.slow  # ~10 s: a run with the logger and a config error in the copy
def test_a_logger_is_one_file_plus_a_yaml(fork):
    (fork / "src" / "halfprec" / "loggers" / "lines.py").write_text(MY_LOGGER)
    (fork / "conf" / "logger" / "lines.yaml").write_text(MY_LOGGER_YAML)
    result = train(fork, "logger=lines", "trainer.log_every=1", "hydra.run.dir=runs/logger")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (fork / "runs" / "logger" / "lines.txt").read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["1", "2", "3", "4", "5", "end"] and lines[-1] == "end completed"
    bad = train(fork, "logger=lines", "logger.lines.every=0", "hydra.run.dir=runs/bad_logger")
    assert bad.returncode == 2 and "logger.lines.every=0" in bad.stderr, bad.stderr[-3000:]


# A loss-scaling rule: a class registered in numerics/scaling.py, whose annotated arguments are the keys
# of its YAML.
MY_SCALER = '''

@register_scaler
class HalvingLossScaler(LossScaler):
    """Halves the scale on every overflow and never grows it."""

    kind = "halving"

    def __init__(
        self,
        init_scale: Annotated[float, Spec(above=0, doc="the first loss scale")] = 1024.0,
        max_consecutive_skips: MaxConsecutiveSkips = None,
        max_overflow_rate: MaxOverflowRate = None,
    ):
        super().__init__(max_consecutive_skips, max_overflow_rate)
        self.scale = self.min_seen = self.max_seen = float(init_scale)

    def _update_scale(self, found_inf: bool) -> None:
        if found_inf:
            self.scale /= 2
            self.backoffs += 1
'''
MY_SCALER_YAML = "# halve on every overflow, never grow\nkind: halving\ninit_scale: 4096.0\nmax_consecutive_skips: 50\n"


@pytest.mark.slow  # ~10 s: a run with the scaler and a config error in the copy
def test_a_loss_scaling_rule_is_a_registered_class_plus_a_yaml(fork):
    scaling = fork / "src" / "halfprec" / "numerics" / "scaling.py"
    scaling.write_text(scaling.read_text() + MY_SCALER)
    (fork / "conf" / "scaler" / "halving.yaml").write_text(MY_SCALER_YAML)
    common = ["precision=fp16", "scaler=halving", "trainer.log_every=1"]
    result = train(fork, *common, "trainer.inject_nonfinite_at=[2,4]", "hydra.run.dir=runs/scaler")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (fork / "runs" / "scaler" / "metrics.jsonl").read_text().splitlines()]
    assert [row["scaler/scale"] for row in rows if "scaler/scale" in row] == [4096, 2048, 2048, 1024, 1024]
    bad = train(fork, *common, "scaler.init_scale=0", "hydra.run.dir=runs/bad_scaler")
    assert bad.returncode == 2 and "scaler.init_scale=0: must be a number > 0 (the first loss scale)" in bad.stderr
