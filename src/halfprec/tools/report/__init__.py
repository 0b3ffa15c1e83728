"""`halfprec report PATH`: markdown tables and plots of a run, a multirun sweep, or a dir of them.

Reads what the runs left on disk (metrics.jsonl, .hydra/overrides.yaml and config.yaml, summary.json,
the sweep's sweep.jsonl), so it works on finished, failed and still-running sweeps alike.

Writes report.md (the tables), loss.png (train/loss against step), scale.png (the loss scale; only
when a job has a loss scaler), sweep.png (final val/loss against a swept number, such as the lr) and,
for a transformer with diagnostics=grads, attn_logits.png and logz.png; into PATH or --out. Runs in an
emulated number format with diagnostics=grads (quant/<layer>/<operand>/rel_err keys) also get
quant_err.png (the mean relative quantization error against step, the largest dashed), grad_noise.png
(diag/grad_noise, the gradient-to-noise ratio, against step) and, per job,
quant_heatmap_<job>.png (each layer's error per operand at its last diagnostics step; at most
quant.MAX_HEATMAPS of them, report.md names the jobs left out). Runs with diagnostics.shadow (any
precision) get, per job and shadow format, shadow_<format>_<job>.png: the relative error the format
would have on each layer (rows) at each diagnostics step (columns), a panel per operand (as many jobs
as heatmaps). A sweep over precision.format gets
bits.png (final val/loss against bits per value); a run `halfprec sensitivity` measured gets
sensitivity_<job>.png; runs with precision.eval get a val/loss@<entry> column per evaluation
precision, a table of each one's val/loss above the run's own at the last validation, and
eval_gap_<entry>.png (that difference against step).

Jobs whose overrides differ in the seed alone (or not at all) form a group: one configuration run
several times. The group table and the plots show each group as mean ± std over its completed jobs;
the per-job table keeps every job. In the plots a group's colour comes from the value of the first
override that varies between groups, its line style from the second; past 20 colours, markers too.
matplotlib, numpy and wandb are imported inside the functions that draw and upload, torch (the
tasks' metrics) once the tables are made: `halfprec --help` loads none of them.

The modules: runs (finding and reading runs into Jobs), values (a metric's value in a job), groups
(configurations and their statistics), columns (the metric columns, from
halfprec/metrics.py), tables (the tables, their cells, report.md), looks, lines, yaxis,
offchart and plots (line plots against step), sweep_plot (sweep.png), bits_plot (bits.png), eval_plot
(eval_gap_<entry>.png), quant
(the quantization plots), shadow (the what-if formats' plots), sensitivity (the sensitivity
heatmaps), upload (W&B).
"""

from __future__ import annotations

import sys
from pathlib import Path

from halfprec.metrics import TRAIN_LOSS, VAL_LOSS
from halfprec.tools.report.bits_plot import bits_figure
from halfprec.tools.report.eval_plot import gap_table, write_eval_plots
from halfprec.tools.report.plots import has_scaler, plot_lines, write_logit_plots
from halfprec.tools.report.quant import write_quant_plots
from halfprec.tools.report.runs import ReportError, find_jobs
from halfprec.tools.report.sensitivity import write_sensitivity_plots
from halfprec.tools.report.shadow import write_shadow_plots
from halfprec.tools.report.sweep_plot import numeric_sweep_key, sweep_figure
from halfprec.tools.report.tables import build_group_table, build_table, markdown_tables, report_text
from halfprec.tools.report.upload import log_to_wandb
from halfprec.tools.report.values import final

__all__ = ["ReportError", "write_report"]


def note(message: str) -> None:
    """Progress and skipped outputs go to stderr, so that stdout is the markdown alone."""
    print(message, file=sys.stderr, flush=True)


def write_report(path: Path, out: Path | None = None, to_wandb: bool = False) -> int:
    """Print the tables, write report.md, loss.png, scale.png, sweep.png (final val/loss against a
    swept number such as the lr), bits.png (a sweep over precision.format), the logit plots of
    transformer diagnostics, the quantization error plots (quant_err.png, quant_heatmap_<job>.png),
    the what-if formats' damage per layer over steps (shadow_<format>_<job>.png), and
    sensitivity_<job>.png for a run with a sensitivity.json, into `out` (default: PATH); 0 on success."""
    jobs = find_jobs(path)
    root = path.resolve()
    out = out or path
    out.mkdir(parents=True, exist_ok=True)
    tables = {"table": build_table(jobs)}
    groups = build_group_table(jobs)
    if groups is not None:
        tables["groups"] = groups
    gaps = gap_table(jobs)  # precision.eval's val/loss@<entry> above the run's own
    if gaps is not None:
        tables["eval_gaps"] = gaps
    where = "/".join(root.parts[-2:])  # e.g. 2026-12-03/08-09-58.123456: the sweep's date and time

    images = []
    if plot_lines(jobs, TRAIN_LOSS.name, f"{TRAIN_LOSS.name}: {where}", out / "loss.png"):
        images.append(out / "loss.png")
    else:
        note(f"no loss.png: no job logged {TRAIN_LOSS.name}")
    if not any(has_scaler(job) for job in jobs):
        note("no scale.png: no job has a loss scaler (scaler/scale is 1.0 throughout)")
    elif plot_lines(jobs, "scaler/scale", f"loss scale: {where}", out / "scale.png", log2_y=True):
        images.append(out / "scale.png")
    swept = numeric_sweep_key(jobs)
    if swept is not None and any(final(job.rows, VAL_LOSS.name) is not None for job in jobs):
        sweep_figure(jobs, swept, VAL_LOSS.name).savefig(out / "sweep.png", dpi=100)
        images.append(out / "sweep.png")
    bits = bits_figure(jobs, VAL_LOSS.name)  # a sweep over number formats
    if bits is not None:
        bits.savefig(out / "bits.png", dpi=100)
        images.append(out / "bits.png")
    images += write_logit_plots(jobs, out, where)  # diagnostics=grads on a transformer (not on a plain MLP)
    images += write_eval_plots(jobs, out, where)  # precision.eval's val/loss@<entry> against the run's own
    quant_images, notes = write_quant_plots(jobs, out, where)  # an emulated number format with diagnostics=grads
    images += quant_images
    shadow_images, shadow_notes = write_shadow_plots(jobs, out)  # diagnostics.shadow's what-if formats
    images += shadow_images
    images += write_sensitivity_plots(jobs, out)  # the runs `halfprec sensitivity` measured

    text = report_text(path, jobs, markdown_tables(tables), images, (*notes, *shadow_notes))
    (out / "report.md").write_text(text)
    print(text, end="", flush=True)
    note(f"wrote {', '.join(p.name for p in [out / 'report.md', *images])} in {out}")
    if to_wandb:
        note(f"W&B report run: {log_to_wandb(root, out, jobs, tables, images)}")
    return 0
