"""The progress display: readable numbers, and a bar that fits an 80-column terminal."""

from __future__ import annotations

import io
import math

import pytest
from rich.console import Console
from rich.text import Text

from halfprec.numerics.scaling import DynamicLossScaler
from halfprec.training.progress import Progress, fmt, status_text


@pytest.mark.parametrize(
    "value,shown",
    [(0.123456, "0.1235"), (2.302585, "2.3026"), (6.3e35, "6.3e+35"), (123456.0, "1.2e+05"), (4e-6, "4.00e-06"),
     (0.0, "0.0000"), (math.nan, "nan"), (math.inf, "inf"), (None, "-")],
)  # fmt: skip
def test_numbers_print_short(value, shown):
    assert fmt(value) == shown


def render(width: int, total: int, scale: float, skips: int) -> str:
    """The line a terminal of `width` columns shows near the end of a run with a diverging loss."""
    console = Console(file=io.StringIO(), width=width, force_terminal=True)
    scaler = DynamicLossScaler(init_scale=scale)
    scaler.skipped_steps = skips
    with Progress(total, console=console) as bar:
        bar.update(total - 20, {"train/loss": 6.3e35, "val/acc": 0.1}, scaler)
    # each render overwrites the line (carriage return): the last one is what stays on the screen
    return Text.from_ansi(console.file.getvalue().split("\r")[-1]).plain.strip("\n")


@pytest.mark.parametrize(
    "total,scale,skips,shown", [(500, 2.0**16, 12, "scale 65536"), (100000, 2.0**24, 1234, "2^24")]
)
def test_the_line_keeps_the_step_count_losses_and_times_at_80_columns(total, scale, skips, shown):
    line = render(80, total, scale, skips)
    assert len(line) <= 80, line
    for part in (f"{total - 20}/{total}", "loss 6.3e+35", "acc 0.100", shown, f"skip {skips}", "0:00:0", "eta"):
        assert part in line, line


def test_a_wide_terminal_also_gets_the_bar():
    line = render(120, 500, 2.0**16, 0)
    assert "━" in line and line.startswith("480/500 ") and line.endswith("-:--:--")


def test_the_line_shows_the_tasks_validation_metric():
    """task=lm reports val/loss (shown as `val`), a classifier val/acc."""
    scaler = DynamicLossScaler(init_scale=2.0**16)
    scaler.kind = "none"
    assert status_text({"train/loss": 2.5, "val/loss": 2.21}, scaler, "val/loss") == "loss 2.5000 val 2.2100"
    assert status_text({"train/loss": 0.1, "val/acc": 0.9731}, scaler, "val/acc") == "loss 0.1000 acc 0.973"
    assert status_text({"train/loss": 3.0, "val/bpb": 3.19}, scaler, "val/bpb") == "loss 3.0000 bpb 3.1900"
