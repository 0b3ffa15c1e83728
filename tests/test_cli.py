"""`train.py` as users run it: every config option, the promised commands, bad values, metrics, W&B.

The option matrix runs in-process (Hydra's compose API + `halfprec.training.run.run`, < 1 s a run);
everything about the command line itself is a real `python train.py ...` subprocess, started
together on a 2-worker pool because each one pays ~8 s of imports (torch, sklearn, wandb).
"""

from __future__ import annotations

import itertools
import math
import os
import re
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import CHEAP, CONF, REPO, read_jsonl
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tiny_data import write_cifar10, write_imagefolder

from halfprec.config.resolvers import register_resolvers

import wandb_records
from helpers import DTYPES

# ---------------------------------------------------------------------------------------------
# Every option of every config group composes and trains a few steps
# ---------------------------------------------------------------------------------------------

# Discovered from conf/, so a new option file is covered without touching this file. `hydra` is
# Hydra's own run/sweep dir layout, exercised by every subprocess test below. Groups that are not
# in train.yaml's defaults list (experiment, ...) are added with `+group=option`, as users do.
IN_DEFAULTS = {
    next(iter(d)) for d in OmegaConf.to_container(OmegaConf.load(CONF / "train.yaml").defaults) if isinstance(d, dict)
}
OPTIONS = [
    f"{'' if group.name in IN_DEFAULTS else '+'}{group.name}={option.stem}"
    # task_optim: chosen by the task and the optimizer together (test_lm.py tests it)
    for group in sorted(p for p in CONF.iterdir() if p.is_dir() and p.name not in ("hydra", "task_optim"))
    for option in sorted(group.glob("*.yaml"))
    if f"{group.name}={option.stem}" not in ("trainer=ddp", "trainer=fsdp")  # need torchrun: test_distributed.py
]
# Options that only work together with another choice.
NEEDS = {"init=fixup": ["model=fixup_resnet"]}
NEEDS |= {f"precision={name}": ["precision.fp8_emulate=true"] for name in ("fp8", "fp8_row")}
# torchao's low-bit AdamW wants a tensor of 4096 values or more (64 x 64) to quantize
NEEDS |= {f"optim={name}": ["model.hidden=[64]"] for name in ("adamw8bit", "adamw4bit", "adamw_fp8")}
# the FP4 recipe's variants are the GPT's (its output head, its last block): two blocks, one kept high
NEEDS |= {f"ablation={p.stem}": ["task=lm", "model.n_layer=2"] for p in (CONF / "ablation").glob("*.yaml")}
# a schedule's trigger reads the diagnostics rows
NEEDS |= {
    f"ablation={p.stem}": ["task=lm", "model.n_layer=2", "diagnostics=grads"]
    for p in (CONF / "ablation").glob("*_sqrt3.yaml")
}


def model_arch(option: Path) -> str:
    """A model option's arch: its own, or that of the option it extends (gpt2.yaml: `defaults: [gpt]`)."""
    cfg = OmegaConf.load(option)
    return cfg.arch if "arch" in cfg else model_arch(option.with_name(f"{cfg.defaults[0]}.yaml"))


def fitting_tasks() -> dict[str, list[str]]:
    """A data or model option that does not fit the default task needs the task that learns from its
    data (task=lm for data=pydoc and model=gpt), found in the registries: a new option needs no entry."""
    from halfprec.components.data import DATASETS
    from halfprec.components.models import MODELS
    from halfprec.components.tasks import TASKS

    def task_for(targets: str) -> str:
        return next(name for name, task in TASKS.items() if task.learns_from == targets)

    targets = {f"data={p.stem}": DATASETS[OmegaConf.load(p).name].targets for p in (CONF / "data").glob("*.yaml")}
    for option in (CONF / "model").glob("*.yaml"):  # a model: the targets of a dataset it can read
        reads = MODELS[model_arch(option)].reads
        targets[f"model={option.stem}"] = next(d.targets for d in DATASETS.values() if d.inputs == reads)
    return {option: [f"task={task_for(t)}"] for option, t in targets.items() if task_for(t) != "classification"}


NEEDS |= fitting_tasks()
# The model options that need task=lm (gpt, gpt2, llama: found above) and the others; the command
# line's sweeps below run each set in the task it needs.
LM_MODELS = sorted(o.split("=")[1] for o, needs in NEEDS.items() if o.startswith("model=") and "task=lm" in needs)
OTHER_MODELS = sorted({p.stem for p in (CONF / "model").glob("*.yaml")} - set(LM_MODELS))
# Scaler options are only meaningful where the loss is scaled: run them in fp16.
GROUP_CONTEXT = {"scaler": ["precision=fp16"]}
# Small versions of each model (fp16 autocast on CPU is slow; timm's resnet18 is 11M parameters), by
# arch: gpt's are model=gpt, gpt2 and llama (heads of 8 values: even, as llama's RoPE needs).
TINY = {
    "mlp": ["model.hidden=[16]"],
    "fixup_resnet": ["model.blocks_per_stage=1", "model.widths=[4,8,8]"],
    "timm": ["model.name=test_resnet"],
    "gpt": ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16"],
}
NO_CUDA = not torch.cuda.is_available()


@pytest.fixture(scope="module")
def disk_data(tmp_path_factory) -> dict[str, list[str]]:
    """Options that read files from disk -> overrides pointing them at tiny copies in the real formats
    (tests/tiny_data.py; not the original CIFAR-10 files, so their md5 sums are not checked)."""
    root = tmp_path_factory.mktemp("disk_data")
    cifar10, folder = write_cifar10(root / "cifar10"), write_imagefolder(root / "imagefolder")
    text, tokens = root / "text", root / "tokens"
    text.mkdir()
    (text / "a.txt").write_text("halfprec reads any text, byte by byte. " * 200)
    tokens.mkdir()
    for name in ("train.bin", "val.bin"):
        (np.arange(4000, dtype=np.uint16) % 256).tofile(tokens / name)
    return {
        "data=text": [f"data.root={text}"],
        "data=tokens": [f"data.root={tokens}", "data.vocab_size=256", "data.num_workers=0"],
        "data=cifar10": [f"data.root={cifar10}", "data.verify=false"],
        "data=imagefolder": [f"data.root={folder}", "data.image_size=32"],
        "experiment+cifar10": [f"data.root={cifar10}", "data.verify=false"],
    }


def compose_cfg(overrides: list[str]):
    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        return compose("train", overrides=overrides)


def option_cfg(option: str, disk_data: dict[str, list[str]]):
    """The composed config for one option, made cheap: few steps, a tiny model, no W&B."""
    group = option.lstrip("+").split("=")[0]
    overrides = [option, *NEEDS.get(option, []), *disk_data.get(option, []), *GROUP_CONTEXT.get(group, [])]
    overrides += [*([] if group == "logger" else ["logger=none"]), *CHEAP, "trainer.progress=false"]
    arch = compose_cfg(overrides).model.arch  # the model an option (or an experiment) picks
    return compose_cfg([*overrides, *TINY.get(arch, []), *NEEDS.get(option, [])])  # an option's needs win


@pytest.mark.parametrize(
    "option",
    [
        pytest.param(o, marks=pytest.mark.skipif(NO_CUDA, reason="TF32 is CUDA-only; CPU failure: test_bad_value"))
        if o == "precision=tf32"
        else o
        for o in OPTIONS
    ],
)
def test_every_config_option_trains(option, tmp_path, disk_data):
    from halfprec.training.run import run

    cfg = option_cfg(option, disk_data)
    summary = run(cfg, tmp_path)

    assert summary["exit_code"] == 0
    rows = read_jsonl(tmp_path / "metrics.jsonl")
    train_rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3]
    assert all(math.isfinite(r["train/loss"]) for r in train_rows), train_rows
    assert 0 <= rows[-1]["val/acc"] <= 1 if cfg.task.name == "classification" else math.isfinite(rows[-1]["val/loss"])
    assert summary["scaler/skipped_steps"] == 0, "a tiny model's first steps must not overflow"

    group, name = option.lstrip("+").split("=")
    first = rows[0]
    if group == "precision":
        p = cfg.precision
        compute, param = DTYPES.get(name, (p.autocast or p.param_dtype, p.param_dtype))
        assert (first["precision/compute_dtype"], first["precision/param_dtype"]) == (compute, param)
        # scaler=auto (the default): dynamic for fp16 modes, none otherwise
        expected_scale = cfg.scaler.init_scale if "float16" in (compute, param) else 1.0
        assert train_rows[0]["scaler/scale"] == expected_scale
    if group == "scaler":
        kind = cfg.scaler.kind
        expected_scale = {"none": 1.0, "static": cfg.scaler.get("scale")}.get(kind, cfg.scaler.get("init_scale"))
        assert [r["scaler/scale"] for r in train_rows] == [expected_scale] * 3
    if group == "logger":
        files = wandb_records.run_files(tmp_path)
        assert len(files) == (name == "wandb") and all(wandb_records.exit_codes(f) == [0] for f in files)
        assert (tmp_path / "tensorboard").exists() == (name == "tensorboard")
        assert (tmp_path / "metrics.csv").exists() == (name == "csv")  # MLflow's store: test_loggers.py


# ---------------------------------------------------------------------------------------------
# The promised commands, as subprocesses (cheap overrides appended)
# ---------------------------------------------------------------------------------------------

PROMISED = {
    "python train.py": [],
    "python train.py precision=bf16 accum=4": ["precision=bf16", "accum=4"],
    "python train.py precision=fp16 scaler=static scaler.scale=128 init=kaiming": [
        "precision=fp16",
        "scaler=static",
        "scaler.scale=128",
        "init=kaiming",
    ],
    "python train.py model=fixup_resnet init=fixup precision=fp16": [
        "model=fixup_resnet",
        "init=fixup",
        "precision=fp16",
    ],
}
SWEEP = ["precision=fp32,fp16,bf16", "scaler=auto,static", "model.hidden=[16]"]
INJECT = ["precision=fp16", "trainer.inject_nonfinite_at=[3]", "trainer.log_every=1", "accum=2"]
INJECT += ["trainer.max_steps=5", "model.hidden=[16]"]  # overrides CHEAP's max_steps=3


@pytest.fixture(scope="module")
def runs(cli):
    """Start every successful-run subprocess of this module at once (the multirun, the longest, first)."""
    futures = {"multirun": cli.submit(*SWEEP, multirun=True)}
    futures |= {command: cli.submit(*overrides) for command, overrides in PROMISED.items()}
    futures["inject"] = cli.submit(*INJECT)
    return futures


# The same matrix from the command line: one multirun per group (or pair of small groups) sweeps
# every option file with Hydra's glob(*), paying the imports once per process.
OPTION_SWEEPS = {
    # tf32 needs CUDA and fp8 an fp8 GPU (it runs emulated in test_every_config_option_trains)
    "precision": [
        "precision=glob(*,exclude=[tf32,fp8,fp8_row])" if NO_CUDA else "precision=glob(*,exclude=[fp8,fp8_row])",
        "model.hidden=[16]",
    ],
    "scaler": ["scaler=glob(*)", "precision=fp16", "model.hidden=[16]"],
    "init": ["init=glob(*,exclude=fixup)", "model=fixup_resnet", "model.blocks_per_stage=1"],  # fixup: PROMISED
    "model": [f"model=glob(*,exclude=[{','.join(LM_MODELS)}])"],
    "task=lm": [
        "task=lm",
        f"model=glob(*,exclude=[{','.join(OTHER_MODELS)}])",  # the models for task=lm, tiny
        *TINY["gpt"],
    ],
    "optim+sched": ["optim=glob(*)", "sched=glob(*)"],
    "data+logger": ["data=glob(*,exclude=[cifar10,imagefolder,pydoc,text,tokens])", "logger=glob(*)"],
    "data=cifar10": ["data=cifar10"],  # the options that read files, each with its own disk_data overrides
    "data=imagefolder": ["data=imagefolder"],
    # eager quantizers: which_gemm's and precision_schedule's compiled ones would compile for minutes here
    "experiment": ["+experiment=glob(*)", "precision.quantizer=eager"],
    # the experiments are digits-sized by default; at scale they take data=cifar10 (and a GPU)
    "experiment+cifar10": [
        "+experiment=glob(*,exclude=[lr_sensitivity,lm_precision,optimizer_precision,master_precision,fp4_recipe,"
        "which_gemm,precision_schedule,shadow,attention_precision,ptq_vs_tokens,tensor_core_accumulation])",
        "data=cifar10",
        "data.num_workers=0",
    ],  # the image experiments (the others are task=lm)
}


@pytest.fixture(scope="module")
def option_sweeps(cli, disk_data):
    return {
        name: cli.submit(
            *([] if "logger" in name else ["logger=none"]), *overrides, *disk_data.get(name, []), multirun=True
        )
        for name, overrides in OPTION_SWEEPS.items()
    }


@pytest.mark.parametrize("sweep", list(OPTION_SWEEPS))
def test_every_config_option_runs_from_the_command_line(sweep, option_sweeps):
    result = option_sweeps[sweep].result()
    assert_clean_exit(result)
    expected = 1
    for override in OPTION_SWEEPS[sweep]:
        if "glob(" in override:
            group = override.lstrip("+").split("=")[0]
            excluded = len(re.findall(r"\w+", override.split("exclude=")[1])) if "exclude=" in override else 0
            expected *= len(list((CONF / group).glob("*.yaml"))) - excluded
    jobs = result.job_dirs()
    assert len(jobs) == expected, [j.name for j in jobs]
    for job in jobs:
        rows = read_jsonl(job / "metrics.jsonl")
        assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3], job.name
        language_model = (
            "name: lm" in (job / ".hydra" / "config.yaml").read_text()
        )  # task=lm (an experiment may pick it)
        assert ("val/bpb" if language_model else "val/acc") in rows[-1], job.name


def assert_clean_exit(result):
    result.check()
    assert "Traceback" not in result.output


@pytest.mark.parametrize("command", list(PROMISED))
def test_promised_command_runs(command, runs):
    result = runs[command].result()
    assert_clean_exit(result)
    overrides = dict(o.split("=", 1) for o in PROMISED[command])
    accum = int(overrides.get("accum", 1))

    rows = result.metrics()
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    assert all(r["samples"] == r["step"] * 16 * accum for r in rows)
    assert math.isfinite(rows[-1]["train/loss"]) and "val/acc" in rows[-1]

    # It says where it writes, first and in its last line; no empty <job>.log beside metrics.jsonl.
    # (On a loaded machine W&B's start can outlast the 3 steps: its wait is said after the done line.)
    lines = [line for line in result.stderr.strip().splitlines() if not line.startswith("W&B is still starting")]
    assert lines[0] == f"run dir: {result.run_dir}"
    assert lines[-1].startswith("done: 3 steps in ") and lines[-1].endswith(f" | {result.run_dir}")
    assert not list(result.run_dir.glob("*.log"))
    # The W&B run lives under the run dir; nothing else is written next to it (no ./wandb, ./outputs).
    assert [p.name for p in result.cwd.iterdir()] == ["run"]
    (run_file,) = wandb_records.run_files(result.run_dir)
    assert wandb_records.exit_codes(run_file) == [0]
    config = wandb_records.config(run_file)
    assert config["precision"]["name"] == overrides.get("precision", "fp32")
    assert config["accum"] == accum
    assert config["init"]["scheme"] == overrides.get("init", "default")
    assert config["model"]["arch"] == overrides.get("model", "mlp")
    if "scaler.scale" in overrides:
        assert {r["scaler/scale"] for r in rows if "scaler/scale" in r} == {float(overrides["scaler.scale"])}
    summary = wandb_records.summary(run_file)
    assert summary["scaler/skipped_steps"] == 0 and summary["val/acc"] == rows[-1]["val/acc"]


# Dashboards and sweeps rely on these names (docs/design.md, "Metrics", and docs/guide/loggers.md's list).
TRAIN_METRICS = {"train/loss", "train/lr", "train/grad_norm"}
SCALER_METRICS = {"scaler/scale", "scaler/skipped", "scaler/skipped_steps", "scaler/growths", "scaler/backoffs"}
SCALER_METRICS |= {"scaler/overflow_rate"}
PERF_METRICS = {"perf/samples_per_s", "perf/step_ms", "perf/tflops"} | ({"perf/max_mem_mb"} if not NO_CUDA else set())
VAL_METRICS = {"val/loss", "val/acc"}


def test_metrics_jsonl_uses_the_documented_names(runs):
    result = runs["python train.py"].result()
    assert_clean_exit(result)
    rows = result.metrics()

    assert all({"step", "samples"} <= row.keys() for row in rows)
    first = rows[0]
    assert first["step"] == 1
    assert (first["precision/compute_dtype"], first["precision/param_dtype"]) == ("float32", "float32")
    train_rows = [r for r in rows if "train/loss" in r]
    assert train_rows, rows
    for row in train_rows:
        missing = (TRAIN_METRICS | SCALER_METRICS | PERF_METRICS) - row.keys()
        assert not missing, f"step {row['step']} lacks {missing}"
    assert VAL_METRICS <= rows[-1].keys()

    documented = documented_metric_names()
    assert {"step", "samples"} | TRAIN_METRICS | SCALER_METRICS | PERF_METRICS | VAL_METRICS <= documented
    unknown = set().union(*rows) - documented - task_metric_names()
    assert not unknown, f"metric names not in docs/design.md's list (add them there first): {unknown}"


@pytest.mark.parametrize(
    "overrides, warning",
    [
        (["sched.warmup_steps=1000", "trainer.max_steps=400"],
         "sched.warmup_steps=1000 is beyond trainer.max_steps=400: the run ends during the warmup, at 40% of optim.lr"),
        (["trainer.val_every=0"], "trainer.val_every=0: validation runs once, after the last step"),
        (["trainer.val_every=100", "trainer.max_steps=200"], None),
        (["diagnostics=grads", "diagnostics.every=0"],
         "diagnostics.every=0: no diagnostics rows (per-layer gradients, update_lost, ...), only the layer each "
         "skipped step's inf/NaN came from (diagnostics.skips): set diagnostics.every > 0 for the rows"),
        (["precision.format=mxfp4", "precision.schedule=[{from_step: 500, format: high}]", "trainer.max_steps=400"],
         "precision.schedule[0].from_step=500 is beyond trainer.max_steps=400: the phase never begins in this run "
         "(resumed with trainer.max_steps >= 500, it would)"),
        (["precision.format=mxfp4", "precision.schedule=[{from_fraction: 0.99, format: high}]"], None),
    ],
)  # fmt: skip
def test_settings_that_rarely_mean_what_they_say_are_warned_about(overrides, warning):
    from halfprec.config import config_warnings

    assert config_warnings(compose_cfg(overrides)) == ([warning] if warning else [])


@pytest.mark.parametrize(
    "precision, flags, slow",
    [
        ("fp16", {"avx512_fp16", "amx_fp16"}, "precision=fp16 computes in fp16, which torch's CPU kernels"),
        ("fp16_pure", None, "precision=fp16_pure computes in fp16"),
        ("bf16", {"avx2", "fma"}, "precision=bf16 computes in bf16 and this CPU has no bf16 units (AVX512-BF16, AMX)"),
        ("mxfp4", {"avx2"}, "precision=mxfp4 computes in bf16 and this CPU has no bf16 units"),  # its other layers
        ("bf16_pure", {"avx512_bf16"}, None),
        ("bf16", {"amx_bf16"}, None),
        ("bf16", None, None),  # a system that does not say: no guess
        ("fp32", {"avx2"}, None),
    ],
)
def test_a_precision_a_cpu_runs_slowly_is_said_at_start(precision, flags, slow, monkeypatch):
    """fp16 on any CPU, bf16 on one without bf16 units: exact, but 10-155x fp32's time there (on a
    GPU, no word)."""
    from halfprec.config import config_warnings, rules

    monkeypatch.setattr(rules, "cpu_flags", lambda: flags)
    cfg = compose_cfg([f"precision={precision}"])
    said = [w for w in config_warnings(cfg, "cpu") if "computes in" in w]
    advice = "precision.autocast=null keeps the other layers in fp32" if precision == "mxfp4" else "precision=fp32"
    assert (said[0].startswith(slow) and advice in said[0]) if slow else not said
    assert not [w for w in config_warnings(cfg, "cuda") if "computes in" in w]


def test_a_run_validates_its_config_once(tmp_path, monkeypatch):
    """train.py checks and types the config, then hands run() the typed one, which it does not check
    again; run() given a composed config checks it; build() never validates."""
    import halfprec.config.typed as typed_module
    import halfprec.training.run as run_module
    from halfprec.config.validate import validate

    calls = []
    monkeypatch.setattr(typed_module, "validate", lambda cfg: calls.append(cfg) or validate(cfg))
    config = typed_module.checked(compose_cfg(["logger=none", "trainer.progress=false", *CHEAP]))
    run_module.run(config, tmp_path / "a")
    assert len(calls) == 1
    run_module.run(compose_cfg(["logger=none", "trainer.progress=false", *CHEAP]), tmp_path / "b")
    assert len(calls) == 2
    assert "validate" not in vars(__import__("halfprec.training.build", fromlist=["build"]))


def test_the_defaults_list_names_every_option_of_each_group():
    """conf/train.yaml's comments are where a user looks for the options: each lists all of them."""
    listed = {}
    for line in (CONF / "train.yaml").read_text().splitlines():
        found = re.match(r"\s*- (\w+): \S+\s+# options: (.*)", line)
        if found:
            listed[found.group(1)] = set(re.findall(r"[\w]+", found.group(2)))
    # task_optim is chosen by the task and the optimizer together (${task}_${optim}), never by name
    assert set(listed) == {p.name for p in CONF.iterdir() if p.is_dir()} - {"hydra", "experiment", "task_optim"}
    for group, words in listed.items():
        options = {p.stem for p in (CONF / group).glob("*.yaml")}
        assert options <= words, f"conf/train.yaml's comment on {group} lacks {options - words}"


def task_metric_names() -> set[str]:
    """A task's own metrics are its documentation (components/tasks: a fork's task adds its own)."""
    from halfprec.components.tasks import TASKS

    return {metric.name for task in TASKS.values() for metric in task.metrics}


def documented_metric_names() -> set[str]:
    """The names in docs/design.md's "Metrics" block: on each indented line, the words before its comment."""
    section = (REPO / "docs" / "design.md").read_text().split("\n## Metrics\n", 1)[1].split("\n## ", 1)[0]
    lines = [line.strip() for line in section.splitlines() if line.startswith("    ")]
    return {name for line in lines for name in re.split(r"\s{3,}", line)[0].split()}


def test_first_step_logs_the_dtypes_it_ran_in(runs):
    """fp16 mixed precision really computes in fp16 with fp32 weights (pure modes: test_every_config_option)."""
    result = runs["python train.py precision=fp16 scaler=static scaler.scale=128 init=kaiming"].result()
    assert_clean_exit(result)
    first = result.metrics()[0]
    assert first["step"] == 1
    assert (first["precision/compute_dtype"], first["precision/param_dtype"]) == ("float16", "float32")


def test_multirun_sweep_is_one_wandb_group_of_named_runs(runs):
    result = runs["multirun"].result()
    assert_clean_exit(result)
    assert [p.name for p in result.cwd.iterdir()] == ["multi"]
    jobs = result.job_dirs()
    assert len(jobs) == 6, [j.name for j in jobs]

    infos = []
    for job in jobs:
        assert read_jsonl(job / "metrics.jsonl")[-1]["step"] == 3
        (run_file,) = wandb_records.run_files(job)  # its own W&B run, under its own job dir
        assert wandb_records.exit_codes(run_file) == [0]
        assert "scaler/skipped_steps" in wandb_records.summary(run_file)
        info = wandb_records.run_info(run_file)
        config = wandb_records.config(run_file)
        choice = config["precision"]["name"], config["scaler"]["kind"]
        for override in (f"precision={choice[0]}", f"scaler={choice[1]}"):  # named by its overrides
            assert re.search(rf"(^|[_,]){re.escape(override)}(,|$)", info["name"]), info
        assert {f"precision:{choice[0]}", f"scaler:{choice[1]}"} <= set(info["tags"]), info
        infos.append((info, choice))

    assert {choice for _, choice in infos} == set(itertools.product(["fp32", "fp16", "bf16"], ["auto", "static"]))
    names = [info["name"] for info, _ in infos]
    assert len(set(names)) == 6, names
    groups = {info["group"] for info, _ in infos}
    assert len(groups) == 1 and groups != {""}, groups


def test_injected_inf_is_skipped_counted_and_reaches_wandb(runs, monkeypatch):
    result = runs["inject"].result()
    assert_clean_exit(result)
    rows = {r["step"]: r for r in result.metrics() if "train/loss" in r}
    assert list(rows) == [1, 2, 3, 4, 5]
    column = lambda key: [rows[s][key] for s in rows]  # noqa: E731

    assert column("scaler/skipped_steps") == [0, 0, 1, 1, 1]
    assert column("scaler/skipped") == [0, 0, 1, 0, 0]
    assert column("scaler/scale") == [65536.0, 65536.0, 32768.0, 32768.0, 32768.0]
    assert column("scaler/backoffs") == [0, 0, 1, 1, 1]
    lr = column("train/lr")
    # train/lr is the lr each step used: step 4 uses step 3's, since skipped step 3 did not advance it
    assert lr[2] > lr[1] and lr[3] == lr[2] and lr[4] > lr[3], f"a skipped step must not advance the schedule: {lr}"
    assert [rows[s]["samples"] for s in rows] == [s * 16 * 2 for s in rows]

    (run_file,) = wandb_records.run_files(result.run_dir)
    history = {h["_step"]: h for h in wandb_records.history(run_file) if "scaler/skipped_steps" in h}
    assert [history[s]["scaler/skipped_steps"] for s in sorted(history)] == [0, 0, 1, 1, 1]
    assert [history[s]["scaler/scale"] for s in sorted(history)] == column("scaler/scale")
    summary = wandb_records.summary(run_file)
    assert summary["scaler/skipped_steps"] == 1
    assert (summary["scaler/min_scale"], summary["scaler/max_scale"]) == (32768.0, 65536.0)
    assert math.isfinite(summary["train/loss"])
    assert wandb_records.exit_codes(run_file) == [0]

    # The W&B run carries the full resolved config: the job's .hydra/config.yaml, resolved.
    config = wandb_records.config(run_file)
    assert config["precision"]["name"] == "fp16" and config["accum"] == 2
    assert config["trainer"]["inject_nonfinite_at"] == [3]
    monkeypatch.setenv("WANDB_MODE", "offline")  # what the run resolved ${oc.env:WANDB_MODE,...} to
    composed = OmegaConf.to_container(OmegaConf.load(result.run_dir / ".hydra/config.yaml"), resolve=True)
    assert composed["trainer"]["threads"] == "auto" and config["trainer"]["threads"] == summary["threads"] == 1
    composed["trainer"]["threads"] = summary["threads"]  # the number `auto` became (OMP_NUM_THREADS=1 here)
    assert composed["sched"]["total_steps"] is None and config["sched"]["total_steps"] == 5
    composed["sched"]["total_steps"] = 5  # null became the run's trainer.max_steps: the schedule's horizon
    assert config == composed


# ---------------------------------------------------------------------------------------------
# Bad values stop before training, with a message naming the key, and no traceback
# ---------------------------------------------------------------------------------------------

# overrides -> (exit code, or None for any non-zero one; substrings the message must contain)
BAD = {
    "accum=0": (2, ["accum=0"]),
    "precision=fp17": (2, ["precision=fp17: no such option", "did you mean precision=fp16?", "bf16, bf16_pure"]),
    "precision=bf-16": (2, ["precision=bf-16", "did you mean precision=bf16?"]),
    "+experiment=fixup": (2, ["experiment=fixup", "did you mean experiment=deep_fixup?", "loss_scaling"]),
    "init=fixup": (2, ["fixup", "model=fixup_resnet"]),
    "trainer.device=cuda": (2, ["trainer.device=cuda"]),
    "precision=tf32": (2, ["tf32", "CUDA"]),
    "precision=fp8": (2, ["precision=fp8", "compute capability 8.9+", "fp8_emulate=true"]),
    "trainer.max_step=3": (2, ["trainer.max_step=3: unknown key for trainer; did you mean max_steps?"]),
    "scaler.scal=64": (2, ["scaler.scal=64: unknown key for scaler.kind=auto", "init_scale"]),
    "optim=adamw optim.momentum=0.9": (2, ["optim.momentum=0.9: unknown key for AdamW", "betas"]),
    "optim=adamw optim.amsgrad=true": (2, ["optim.amsgrad=true: not a key of the config", "+optim.amsgrad=true"]),
    "model=timm model.name=resnet1": (2, ["model.name=resnet1: no such timm model; did you mean resnet18"]),
    "accum=abc": (None, ["accum=abc"]),
    "scaler=static scaler.scale=-1": (None, ["scaler.scale=-1"]),
    # one line that hits the point, where Hydra's or Python's own first line misled
    "precision=fp32,bf16": (2, ["precision=fp32,bf16: a comma list is a sweep: add -m (python train.py -m"]),
    "experiment=loss_scaling": (2, ["experiment is not in train.yaml's defaults: add it with +experiment=loss_"]),
    "task=lm model=mlp": (
        2,
        ["model=mlp: reads images or vectors, and data=pydoc gives token sequences: use model=gpt"],
    ),
    "task=lm data=digits": (2, ["data=digits: gives class labels and task=lm learns from token sequences: use data="]),
    "optim=adamw optim.betas=0.9": (2, ["optim.betas=0.9: AdamW takes 2 values here", "optim.betas=[0.9,0.999]"]),
    "precision=fp16 scaler.min_scale=1e6": (2, ["scaler.min_scale=1000000.0: above scaler.init_scale=65536"]),
    "+experiment=loss_scaling": (2, ["+experiment=loss_scaling: is a sweep of 18 jobs over precision, scaler, seed"]),
    "hparams_search=optuna": (2, ["hparams_search=optuna: is a sweep over optim.lr, scaler.init_scale, accum"]),
    "trainer=5": (2, ["trainer=5: no such option in conf/trainer/; options: ddp, default, fsdp"]),
    "precision=mxfp4 precision.recipe=nvfp4": (2, ["precision.recipe=nvfp4: a mapping of grad_format,", "=nvfp4 is"]),
    "precision=nvfp4 precision.recipe.scale_rule=rceil": (2, ["scale_rule=rceil: is for formats with E8M0 scales"]),
    # a model that cannot read the data's samples: a dry forward of one sample, not step 1's traceback
    "data=synthetic data.shape=[13] model=fixup_resnet": (
        2,
        ["model=fixup_resnet: cannot read data=synthetic's samples of shape [13]", "set data.shape to", "model=mlp"],
    ),
    # split on its spaces as an unquoted shell word is: the pieces are one override, quoted
    "precision=mxfp4 precision.schedule=[{from_step: 10, gemms: [forward], format: high}]": (
        2,
        [
            "the shell split this override",
            "quote the whole override: 'precision.schedule=[{from_step: 10, gemms: [forward], format: high}]'",
        ],
    ),  # fmt: skip
    "+logger=csv": (2, ["+logger=csv: train.yaml chooses logger already", "write logger=csv", "logger=[wandb,csv]"]),
    "logger=[csv,tensorbord]": (2, ["logger=tensorbord: no such option", "did you mean logger=tensorboard?", "mlflow"]),
}
NEEDS_NO_CUDA = {"trainer.device=cuda", "precision=tf32", "precision=fp8"}


@pytest.fixture(scope="module")
def bad_runs(cli):
    return {bad: cli.submit(*bad.split()) for bad in BAD if not (bad in NEEDS_NO_CUDA and not NO_CUDA)}


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(b, marks=pytest.mark.skipif(not NO_CUDA, reason="a GPU is visible")) if b in NEEDS_NO_CUDA else b
        for b in BAD
    ],
)
def test_bad_value_stops_with_a_clear_message(bad, bad_runs):
    code, needles = BAD[bad]
    result = bad_runs[bad].result()
    assert result.returncode != 0 and (code is None or result.returncode == code), (result.returncode, result.output)
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle.lower() in result.stderr.lower(), f"{needle!r} not in:\n{result.stderr}"
    (line,) = result.stderr.strip().splitlines()  # one line, `error: key=value: what would work`
    assert line.startswith("error: ")
    assert not result.run_dir.exists(), "a config error leaves no run dir (it would hold .hydra/ alone)"


@pytest.mark.parametrize("option", [pytest.param("model=timm", marks=pytest.mark.slow), "data=cifar10"])  # timm: ~13 s
def test_a_torchvision_that_does_not_match_torch_is_one_line(option, cli, tmp_path, monkeypatch):
    """A torchvision built for another torch release fails on import with "operator torchvision::nms
    does not exist" (simulated here by a torchvision first on the path that raises it): the options
    that need torchvision say which versions clash and the pip command that installs the match."""
    from halfprec.components.torchvision_import import reinstall_command

    fake = tmp_path / "fake" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake.parent), os.environ.get("PYTHONPATH", "")]))
    if option == "model=timm":
        overrides = ["model=timm", "model.name=test_resnet", "data=synthetic", "data.shape=[3,32,32]"]
    else:
        overrides = ["data=cifar10", f"data.root={write_cifar10(tmp_path / 'cifar10')}", "data.verify=false"]
    result = cli.run(*overrides, "logger=none")
    clash = f"torch {torch.__version__} and torchvision {metadata.version('torchvision')} do not match"
    fix = f"(operator torchvision::nms does not exist); {reinstall_command(torch.__version__)}"
    assert (result.returncode, result.stderr.strip()) == (2, f"error: {option}: {clash} {fix}"), result.output


def test_the_torchvision_to_install_is_the_one_built_for_this_torch():
    from halfprec.components.torchvision_import import reinstall_command

    assert reinstall_command("2.6.0") == 'pip install "torchvision==0.21.*"'  # PyTorch's pairs: 2.6 with 0.21
    cpu = 'pip install "torchvision==0.29.*" --index-url https://download.pytorch.org/whl/cpu'
    assert reinstall_command("2.14.1+cpu") == cpu
    assert reinstall_command("2.8.0+cu128").endswith(
        '"torchvision==0.23.*" --index-url https://download.pytorch.org/whl/cu128'
    )


@pytest.mark.parametrize(
    "overrides, message",
    [
        (['accum="4"'], 'accum="4": must be an integer >= 1'),  # a string: shown quoted, unlike the fix's accum=4
        (["logger=csv", "+logger.csv.path=x"], "logger.csv.path=x: unknown key for logger=csv; it takes no keys"),
    ],
)
def test_a_config_error_shows_the_value_as_given_and_what_the_key_takes(overrides, message):
    from halfprec.config import validate
    from halfprec.errors import ConfigError

    with pytest.raises(ConfigError) as info:
        validate(compose_cfg(overrides))
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "overrides, shape",
    [
        (["data=synthetic", "data.shape=[13]", "model=fixup_resnet", *TINY["fixup_resnet"]], "[13]"),
        (["data=synthetic", "data.shape=[3,32]", "model=timm", *TINY["timm"]], "[3, 32]"),
    ],
)
def test_a_model_that_cannot_read_the_datas_samples_is_a_config_error(overrides, shape):
    """docs/guide/extending.md: a model that does not fit its samples is one config error naming both."""
    from halfprec.config import validate
    from halfprec.errors import ConfigError
    from halfprec.training.build import build

    cfg = compose_cfg(overrides)
    validate(cfg)
    with pytest.raises(ConfigError) as info:
        build(cfg)
    arch = cfg.model.arch
    assert str(info.value).startswith(f"model={arch}: cannot read data=synthetic's samples of shape {shape} (")
    assert str(info.value).endswith("set data.shape to one it reads ([C, H, W] for a conv net), or model=mlp (it "
                                    "reads any shape)")  # fmt: skip


@pytest.mark.parametrize(
    "override",
    ["+trainer.max_step=3", "+scaler.init_scal=2", "+precision.autocas=float16", "+sched.warmup=3", "+accum_steps=4",
     "+init.mode=fan_in", "+logger.projekt=x", "+model.hiden=[8]", "+data.batchsize=8", "+optim.momentun=0.5"],
)  # fmt: skip
def test_appended_unknown_key_is_rejected(override):
    """Hydra answers `trainer.max_step=3` with 'use +trainer.max_step=3'; that must not silently train 500 steps."""
    from halfprec.config import validate, validate_optimizer
    from halfprec.errors import ConfigError

    key = override[1:].split("=")[0]
    with pytest.raises(ConfigError, match=re.escape(key) + ".*unknown key"):
        cfg = compose_cfg([override])
        validate(cfg)
        validate_optimizer(cfg)


def test_multirun_records_every_job_in_sweep_jsonl_and_a_bad_job_does_not_stop_the_others(cli):
    result = cli.run("init=fixup,default", "model.hidden=[16]", multirun=True)
    assert result.returncode == 5 and "Traceback" not in result.output  # a sweep with a failed job
    assert (
        result.stderr.strip().splitlines()[-1]
        == f"sweep: 1 completed, 1 failed; {result.sweep_dir}/sweep.jsonl (exit 5)"
    )
    lines = read_jsonl(result.sweep_dir / "sweep.jsonl")
    by_status = {line["status"]: line for line in lines}
    assert len(lines) == 2 and set(by_status) == {"completed", "failed"}
    failed, done = by_status["failed"], by_status["completed"]
    assert "init=fixup" in failed["overrides"] and "no residual branches" in failed["error"]
    assert "init=default" in done["overrides"] and done["scaler/skipped_steps"] == 0
    assert done["val/acc"] == read_jsonl(Path(done["dir"]) / "metrics.jsonl")[-1]["val/acc"]
    assert done["wall_s"] > 0


def test_slurm_launcher_config_composes_with_requeue_on(tmp_path):
    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        cfg = compose("train", overrides=["hydra/launcher=slurm"], return_hydra_config=True)
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("SlurmLauncher")
    assert launcher.max_num_timeout >= 1 and launcher.signal_delay_s > 0


def test_submitit_local_launcher_runs_a_sweep(cli):
    result = cli.run("hydra/launcher=submitit_local", "seed=0,1", "model.hidden=[16]", "logger=none", multirun=True)
    assert_clean_exit(result)
    lines = read_jsonl(result.sweep_dir / "sweep.jsonl")
    assert sorted(line["status"] for line in lines) == ["completed", "completed"]
    assert all((Path(line["dir"]) / "metrics.jsonl").exists() for line in lines)


def test_joblib_launcher_runs_jobs_in_parallel_each_with_its_own_wandb_run(cli):
    result = cli.run("hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "seed=0,1", "model.hidden=[16]", multirun=True)
    assert_clean_exit(result)
    lines = read_jsonl(result.sweep_dir / "sweep.jsonl")
    assert sorted(line["job"] for line in lines) == [0, 1] and {line["status"] for line in lines} == {"completed"}
    files = [wandb_records.run_files(Path(line["dir"])) for line in lines]
    assert all(len(f) == 1 and wandb_records.exit_codes(f[0]) == [0] for f in files)
    ids = {wandb_records.run_info(f[0])["id"] for f in files}
    assert len(ids) == 2


def test_experiments_define_their_sweeps():
    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        acc = compose("train", overrides=["+experiment=accumulation", "accum=4"], return_hydra_config=True)
        depth = compose("train", overrides=["+experiment=init_depth"], return_hydra_config=True)
        fixup = compose("train", overrides=["+experiment=fixup_depth"], return_hydra_config=True)
        rounding = compose("train", overrides=["+experiment=bf16_pure_rounding"], return_hydra_config=True)
    assert acc.data.batch_size * acc.accum == 256  # fixed effective batch
    assert set(acc.hydra.sweeper.params) == {"accum", "precision"}
    assert depth.model.arch == "fixup_resnet" and set(depth.hydra.sweeper.params) == {"init", "model.blocks_per_stage"}
    assert fixup.model.arch == "fixup_resnet"
    assert dict(fixup.hydra.sweeper.params) == {
        "init": "default,kaiming,fixup", "precision": "fp32,fp16", "model.blocks_per_stage": "1,6"
    }  # fmt: skip
    # every precision in the rounding sweep is an option file whose update rule is what its name says
    variants = rounding.hydra.sweeper.params.precision.split(",")
    assert variants == ["fp32", "bf16_pure", "bf16_pure_kahan", "bf16_pure_stochastic", "bf16_pure_master"]
    with initialize_config_dir(str(CONF), version_base="1.3"):
        chosen = {v: compose("train", overrides=[f"precision={v}"]).precision for v in variants[1:]}
    assert [(p.param_dtype, p["update"], p.master_weights) for p in chosen.values()] == [
        ("bfloat16", "nearest", False), ("bfloat16", "kahan", False), ("bfloat16", "stochastic", False),
        ("bfloat16", "nearest", True),
    ]  # fmt: skip


def test_the_language_model_experiments_sweep_lr_and_precision_on_the_gpt():
    register_resolvers()
    with initialize_config_dir(str(CONF), version_base="1.3"):
        lr = compose("train", overrides=["+experiment=lr_sensitivity"], return_hydra_config=True)
        precision = compose("train", overrides=["+experiment=lm_precision"], return_hydra_config=True)
    for cfg in (lr, precision):
        assert (cfg.task.name, cfg.model.arch, cfg.data.name, cfg.optim._target_) == (
            "lm",
            "gpt",
            "pydoc",
            "torch.optim.AdamW",
        )
    lrs = [float(v) for v in lr.hydra.sweeper.params["optim.lr"].split(",")]
    assert max(lrs) / min(lrs) >= 1000 and lr.hydra.sweeper.params["model.qk_norm"] == "false,true"
    assert lr.diagnostics.every > 0  # the attention logits are logged along the way
    assert precision.hydra.sweeper.params.precision.split(",")[:3] == ["fp32", "fp16", "bf16"]
