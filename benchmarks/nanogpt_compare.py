"""halfprec's task=lm recipe against a hand-written nanoGPT-style training loop: same model, same data.

    python benchmarks/nanogpt_compare.py [--seeds 0,1,2] [--steps 400] [--quick] [--json OUT.json]
                                         [--halfprec-overrides KEY=VALUE ...] [--control]

An independent check of halfprec's language-modelling recipe. For every seed:

  halfprec  `halfprec.training.run.run(cfg, run_dir)` with `task=lm seed=S trainer.max_steps=N logger=none`
            and the --halfprec-overrides, in a temporary run dir: what `python train.py task=lm` does
  nanoGPT   a training loop written here from Karpathy's nanoGPT train.py conventions: AdamW over two
            param groups (tensors of >= 2 dims decay, those of < 2 dims do not: norm gains, biases;
            embeddings decay), `get_lr` (linear warmup for warmup_iters, then cosine to min_lr = lr/10
            at lr_decay_iters = max_iters), clip_grad_norm_, `zero_grad(set_to_none=True)`, autocast
            and GradScaler (fp16 only) as nanoGPT's `dtype` setting does

Both get the same composed config (the overrides apply to both, so both train the same model on the
same data with the same hyperparameters): the nanoGPT loop takes the model and data of
`halfprec.training.build.build(cfg)` (a fresh GPT seeded by cfg.seed: the initial weights halfprec
starts from; `c.data.train_batches(...)`: halfprec's micro-batches in halfprec's order), reads lr,
betas, eps, weight_decay, warmup, clipping, accum and the step budget from cfg, and is scored by the
function halfprec's own validation calls (`halfprec.training.metrics.evaluate`), so both val/loss
values are nats per token over the same validation tokens.

--control gives the nanoGPT loop halfprec's two conventions instead of nanoGPT's (halfprec's decay
split, read off halfprec's built optimizer, and halfprec's schedule, `build.lr_factor`): the two
val/losses must then agree to float rounding, which shows that the data, model and evaluation are
shared and that any difference without it comes from the recipes.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from halfprec.config import Config, compose
from halfprec.training.build import Components, build, lr_factor, schedule_args
from halfprec.training.metrics import evaluate
from halfprec.training.run import run

CONF = Path(__file__).resolve().parents[1] / "conf"
# A 1-block GPT of width 32 on 4 x 32 bytes, as benchmarks/formats.py --quick; 2 warm-up steps so
# that 10 steps still reach the cosine part of both schedules (task=lm's 40 would not end).
QUICK = ("model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=4")
QUICK_SCHED = ("sched.warmup_steps=2",)
AUTOCAST = {"bfloat16": torch.bfloat16, "float16": torch.float16}


def compose_cfg(seed: int, steps: int, overrides: list[str]) -> Config:
    """A fresh config per use: run() writes into its cfg (sched.total_steps, trainer.threads)."""
    fixed = [f"seed={seed}", f"trainer.max_steps={steps}", "logger=none", "trainer.progress=false"]
    return compose(["task=lm", *fixed, *overrides], CONF)


def check_nanogpt_can_run(cfg: Config) -> None:
    """nanoGPT trains with AdamW, and its precision setting is an autocast dtype over fp32 weights:
    pure, fp8 and emulated number formats change the model itself, which the loop does not mirror."""
    if cfg.optim._target_ != "torch.optim.AdamW":  # the loop's optimizer is nanoGPT's, AdamW
        sys.exit(f"optim._target_={cfg.optim._target_}: the nanoGPT loop compares AdamW recipes only")
    p = cfg.precision
    if p.param_dtype != "float32" or p.format:
        sys.exit(f"precision={p.name}: the nanoGPT loop runs fp32 weights under autocast only (fp32, tf32, bf16, fp16)")


# ---------------------------------------------------------------- halfprec's own run


def run_halfprec(seed: int, steps: int, overrides: list[str]) -> dict:
    """`python train.py task=lm ...` in-process, in a throw-away run dir; its val/loss, and the lr of
    its first and last step as its metrics.jsonl recorded them (what it really used)."""
    cfg = compose_cfg(seed, steps, overrides)
    with tempfile.TemporaryDirectory(prefix="nanogpt_compare_") as run_dir:
        summary = run(cfg, run_dir)
        rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["train/lr"] for r in rows if "train/lr" in r]  # rows at step 1, every log_every and the last
    return {"val_loss": summary["val/loss"], "first_lr": lrs[0], "last_lr": lrs[-1]}


# ---------------------------------------------------------------- the nanoGPT-style loop


def get_lr(it: int, learning_rate: float, warmup_iters: int, lr_decay_iters: int, min_lr: float) -> float:
    """nanoGPT's train.py get_lr, as written there."""
    if it < warmup_iters:  # 1) linear warmup for warmup_iters steps
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:  # 2) past lr_decay_iters, min_lr
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)  # 3) cosine down to min_lr
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


def nanogpt_groups(model: nn.Module, weight_decay: float, decays: set[str] | None = None) -> list[dict]:
    """nanoGPT's configure_optimizers: every 2D+ tensor decays (matmul weights and embeddings), the
    rest (norm gains, biases) does not. named_parameters() lists a tied weight once (wte, not lm_head).
    `decays` (--control): the names that decay instead. Names are kept for the report only."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    decaying = {n for n, p in named if (p.dim() >= 2 if decays is None else n in decays)}
    decay = [(n, p) for n, p in named if n in decaying]
    no_decay = [(n, p) for n, p in named if n not in decaying]
    return [
        {"params": [p for _, p in decay], "weight_decay": weight_decay, "names": [n for n, _ in decay]},
        {"params": [p for _, p in no_decay], "weight_decay": 0.0, "names": [n for n, _ in no_decay]},
    ]


def halfprec_decay_names(c: Components) -> set[str]:
    """--control: which tensors halfprec's optimizer decays, read off the optimizer build(cfg) made
    (whatever optim.no_decay says; every tensor in a version without param groups)."""
    names = {id(p): n for n, p in c.model.named_parameters()}
    return {names[id(p)] for g in c.stepper.optimizer.param_groups if g.get("weight_decay", 0) > 0 for p in g["params"]}


def autocast_and_scaler(cfg: Config, device: torch.device) -> tuple[AbstractContextManager, torch.amp.GradScaler]:
    """nanoGPT's `ctx` and `scaler`: autocast to the precision's dtype (none in fp32), a GradScaler
    enabled for float16 only."""
    dtype = AUTOCAST.get(cfg.precision.autocast or "")
    ctx = torch.autocast(device.type, dtype=dtype) if dtype else nullcontext()
    return ctx, torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)


def lr_at(it: int, cfg: Config, control: bool) -> float:
    """The lr of step `it` (0-based): nanoGPT's get_lr with min_lr = lr/10 and lr_decay_iters =
    max_iters; --control: halfprec's schedule (sched.*), from halfprec's own function."""
    lr, steps = cfg.optim.lr, cfg.trainer.max_steps
    if control:
        return lr * lr_factor(it, *schedule_args(cfg))
    return get_lr(it, lr, cfg.sched.warmup_steps, steps, lr / 10)


def train_nanogpt(seed: int, steps: int, overrides: list[str], control: bool = False) -> dict:
    """nanoGPT's training loop over halfprec's model and batches; scored by halfprec's evaluate()."""
    cfg = compose_cfg(seed, steps, overrides)
    check_nanogpt_can_run(cfg)
    # build() seeds with cfg.seed and makes the same fresh GPT and dataset as halfprec's run. It also
    # builds halfprec's optimizer, scheduler and stepper: unused here (--control reads its groups).
    c = build(cfg)
    model, device, o = c.model, c.device, cfg.optim.args
    batches = c.data.train_batches(cfg.data.batch_size, cfg.seed, device, 0, 1)
    groups = nanogpt_groups(model, o["weight_decay"], halfprec_decay_names(c) if control else None)
    optimizer = torch.optim.AdamW(groups, lr=cfg.optim.lr, betas=tuple(o["betas"]), eps=o["eps"])
    ctx, scaler = autocast_and_scaler(cfg, device)
    grad_clip, accum = cfg.optim.clip_grad_norm or 0.0, cfg.accum  # nanoGPT: grad_clip 0.0 = off
    lrs = []
    model.train()
    for it in range(steps):  # halfprec's step budget (nanoGPT's own loop runs max_iters + 1 steps)
        lrs.append(lr_at(it, cfg, control))
        for group in optimizer.param_groups:
            group["lr"] = lrs[-1]
        for _ in range(accum):  # gradient_accumulation_steps
            x, y = next(batches)
            with ctx:
                logits = model(x)
                loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-1) / accum
            scaler.scale(loss).backward()
        if grad_clip != 0.0:
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    # halfprec's val/loss comes from Validator.run() -> halfprec.training.metrics.evaluate(model, data,
    # task, policy, data.batch_size, device): task=lm's LanguageModellingEvaluator sums fp32
    # cross-entropy over every validation token (in data.val_batches order, batches of
    # task.val_batch_size) and divides by the token count. Calling it here scores the same tokens
    # the same way (under the same policy.autocast() as halfprec's run).
    val = evaluate(model, c.data, c.stepper.task, c.stepper.policy, cfg.data.batch_size, device)
    return {"val_loss": val["val/loss"], "first_lr": lrs[0], "last_lr": lrs[-1], "groups": describe(groups)}


def describe(groups: list[dict]) -> dict:
    """Per group: weight decay, tensor names and counts (the JSON; the test checks the split)."""
    keys = ("decay", "no_decay")
    return {
        k: {
            "weight_decay": g["weight_decay"],
            "names": g["names"],
            "tensors": len(g["params"]),
            "numel": sum(p.numel() for p in g["params"]),
        }
        for k, g in zip(keys, groups)
    }


# ---------------------------------------------------------------- the report


def halfprec_groups(overrides: list[str], steps: int) -> list[str]:
    """How halfprec's optimizer splits weight decay for this config, in words: read off the
    optimizer build(cfg) makes, so that it stays true whatever halfprec's defaults become."""
    c = build(compose_cfg(0, steps, overrides))
    names = {id(p): n for n, p in c.model.named_parameters()}
    out = []
    for i, g in enumerate(c.stepper.optimizer.param_groups):
        tensors = [names.get(id(p), "?") for p in g["params"]]
        low = sum(1 for p in g["params"] if p.dim() < 2)
        out.append(
            f"group {g.get('name', i)!r}: weight_decay {g.get('weight_decay', 0):g}, {len(tensors)} tensors "
            f"({low} of < 2 dims), e.g. {', '.join(tensors[:3])}"
        )
    return out


def differences(cfg: Config, seeds: list[dict], halfprec_split: list[str], control: bool) -> list[str]:
    """The recipes side by side, from the config and what each run really used (lr of step 1 and of
    the last step: halfprec's from its metrics.jsonl)."""
    h, n = seeds[0]["halfprec"], seeds[0]["nanogpt"]
    g = n["groups"]
    s, o, args = cfg.sched, cfg.optim, cfg.optim.args
    lines = [f"- halfprec param groups: {'; '.join(halfprec_split)}"]
    lines.append(
        f"- nanoGPT loop param groups{' (--control: halfprec split)' if control else ''}: decay "
        f"{g['decay']['tensors']} tensors ({g['decay']['numel']:,} values, weight_decay {args['weight_decay']:g}), "
        f"no decay {g['no_decay']['tensors']} tensors ({g['no_decay']['numel']:,} values)"
    )
    lines.append(
        f"- halfprec lr: sched={s.name}, {s.warmup_steps} warmup steps (lr*(step+1)/warmup), then cosine to "
        f"min_lr_ratio*lr = {o.lr * getattr(s, 'min_lr_ratio', 0.0):.3g} at step {cfg.trainer.max_steps}; "
        f"used {h['first_lr']:.3g} at step 1, {h['last_lr']:.3g} at the last step"
    )
    if not control:
        lines.append(
            f"- nanoGPT loop lr: get_lr, {s.warmup_steps} warmup steps (lr*(it+1)/(warmup+1)), then cosine to "
            f"min_lr = lr/10 = {o.lr / 10:.3g} at lr_decay_iters = max_iters = {cfg.trainer.max_steps}; "
            f"used {n['first_lr']:.3g} at step 1, {n['last_lr']:.3g} at the last step"
        )
    shape = f"{cfg.data.batch_size} x {cfg.model.args['block_size']} tokens x accum {cfg.accum}"
    z = cfg.task.args["z_loss"]
    z_loss = f"; halfprec adds z_loss {z:g} to its training loss" if z else ""
    lines.append(
        f"- both: AdamW lr {o.lr:g} betas {tuple(args['betas'])} eps {args['eps']:g}, clip {o.clip_grad_norm}, "
        f"{shape}, "
        f"{cfg.trainer.max_steps} steps; halfprec skips a step whose gradients hold inf/NaN, nanoGPT does not{z_loss}"
    )
    return lines


def mean_std(values: list[float], spec: str = ".4f") -> str:
    """mean ± sample std over the seeds (one seed has no spread to show)."""
    if len(values) == 1:
        return f"{values[0]:{spec}} (1 seed)"
    return f"{statistics.mean(values):{spec}} ± {statistics.stdev(values):.4f}"


def markdown(cfg: Config, seeds: list[dict], recipes: list[str], command: str) -> str:
    lines = [f"`{command}`", "", *recipes, ""]
    lines += ["| seed | halfprec val/loss | nanoGPT-loop val/loss | nanoGPT - halfprec |", "|---:|---:|---:|---:|"]
    for s in seeds:
        h, n = s["halfprec"]["val_loss"], s["nanogpt"]["val_loss"]
        lines.append(f"| {s['seed']} | {h:.4f} | {n:.4f} | {n - h:+.4f} |")
    h_all = [s["halfprec"]["val_loss"] for s in seeds]
    n_all = [s["nanogpt"]["val_loss"] for s in seeds]
    diff = [n - h for n, h in zip(n_all, h_all)]
    lines.append(f"| mean ± std | {mean_std(h_all)} | {mean_std(n_all)} | {mean_std(diff, '+.4f')} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default=None, help="comma-separated (default 0,1,2; --quick: 0)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: 400; --quick: 10)")
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 seed, 10 steps, a 1-block GPT of width 32")
    parser.add_argument("--json", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--control", action="store_true", help="nanoGPT loop with halfprec's groups and schedule")
    parser.add_argument(
        "--halfprec-overrides", nargs="*", default=[], metavar="KEY=VALUE", help="Hydra overrides for both sides"
    )
    args = parser.parse_args(argv)
    args.seeds = [int(s) for s in (args.seeds or ("0" if args.quick else "0,1,2")).split(",")]
    args.steps = args.steps or (10 if args.quick else 400)
    # the quick model first, so that an override given on the command line wins over it
    args.overrides = [*QUICK, *QUICK_SCHED, *args.halfprec_overrides] if args.quick else list(args.halfprec_overrides)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    check_nanogpt_can_run(compose_cfg(args.seeds[0], args.steps, args.overrides))  # before any run
    seeds = []
    for seed in args.seeds:
        # halfprec first: run() sets torch's CPU threads (trainer.threads), and the nanoGPT loop then
        # computes with the same number, so that neither side's reductions are summed differently
        halfprec = run_halfprec(seed, args.steps, args.overrides)
        nanogpt = train_nanogpt(seed, args.steps, args.overrides, args.control)
        print(f"seed {seed}: halfprec {halfprec['val_loss']:.4f}, nanoGPT {nanogpt['val_loss']:.4f}", file=sys.stderr)
        seeds.append({"seed": seed, "halfprec": halfprec, "nanogpt": nanogpt})
    cfg = compose_cfg(args.seeds[0], args.steps, args.overrides)
    recipes = differences(cfg, seeds, halfprec_groups(args.overrides, args.steps), args.control)
    command = " ".join(["python", "benchmarks/nanogpt_compare.py", *(argv if argv is not None else sys.argv[1:])])
    print(markdown(cfg, seeds, recipes, command))
    if args.json:
        settings = {"steps": args.steps, "overrides": args.overrides, "control": args.control, "command": command}
        report = {"settings": settings, "differences": recipes, "seeds": seeds}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
