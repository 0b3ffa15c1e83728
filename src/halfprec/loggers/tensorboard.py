"""TensorBoard: event files under `<run dir>/tensorboard/`; `tensorboard --logdir outputs` shows
every run, a sweep's runs side by side under its dir."""

from __future__ import annotations

import json
from typing import Annotated, Any

from omegaconf import OmegaConf

from halfprec.loggers import Histogram, RunInfo, register_logger
from halfprec.spec import Spec


@register_logger("tensorboard", "TensorBoard", package="tensorboard", install="pip install tensorboard")
class TensorBoardSink:
    """Scalars and histograms by step; the config, tags and summary as text.

    A resumed run writes into the same dir from the checkpoint's step on: TensorBoard's purge step
    makes its reader drop what the first attempt logged after that step, so no step shows twice."""

    def __init__(self, run: RunInfo, *, flush_secs: Annotated[int, Spec(low=1, doc="seconds between writes to disk")]):
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        purge_step = None if run.resume_step is None else run.resume_step + 1
        self.writer = SummaryWriter(str(run.dir / "tensorboard"), purge_step=purge_step, flush_secs=flush_secs)
        self.step = run.resume_step or 0
        if run.resume_step is None:
            self.writer.add_text("config", as_code(OmegaConf.to_yaml(run.config)), 0)
            identity = {"name": run.name, "group": run.group, "tags": run.tags}
            self.writer.add_text("run", as_code(json.dumps(identity)), 0)

    def log(self, row: dict[str, Any]) -> None:
        self.step = step = row["step"]
        for key, value in row.items():
            if key == "step" or value is None:
                continue
            if isinstance(value, Histogram):
                if sum(value.counts):  # TensorBoard refuses an empty one
                    add_histogram(self.writer, key, value, step)
            elif isinstance(value, bool | int | float):
                self.writer.add_scalar(key, value, step)

    def finish(self, summary: dict[str, Any]) -> None:
        self.writer.add_text("summary", as_code(json.dumps(summary, indent=1, default=str)), self.step)
        self.writer.close()

    def abandon(self) -> None:
        self.writer.close()

    def state(self) -> dict[str, Any]:
        return {}  # the dir is the run dir's: a resume finds it


def as_code(text: str) -> str:
    """Markdown (TensorBoard's text tab) that shows `text` as it is: indented as code."""
    return "\n".join("    " + line for line in text.splitlines())


def add_histogram(writer: Any, key: str, hist: Histogram, step: int) -> None:
    """A binned histogram as TensorBoard takes one: its sums from the bins' centres (the values
    themselves are not kept)."""
    centres = [(lo + hi) / 2 for lo, hi in zip(hist.edges, hist.edges[1:])]
    writer.add_histogram_raw(
        key,
        min=hist.edges[0],
        max=hist.edges[-1],
        num=sum(hist.counts),
        sum=sum(c * x for c, x in zip(hist.counts, centres)),
        sum_squares=sum(c * x * x for c, x in zip(hist.counts, centres)),
        bucket_limits=hist.edges[1:],
        bucket_counts=hist.counts,
        global_step=step,
    )
