"""CSV: `<run dir>/metrics.csv`, one row per metric row and one column per metric, for
spreadsheets and pandas; metrics.jsonl holds the same rows."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from halfprec.loggers import Histogram, RunInfo, register_logger


@register_logger("csv", "CSV", package="csv", install="(part of Python)")
class CsvSink:
    """Columns in the order metrics first appear, `step` first. Validation and diagnostics rows
    bring new columns after the first training rows: the file is then written again with the wider
    header (rare: a run's keys are all known after its first validation). A resumed run drops the
    rows after its checkpoint's step, as metrics.jsonl does."""

    def __init__(self, run: RunInfo):
        self.path = run.dir / "metrics.csv"
        self.columns: list[str] = ["step"]
        rows: list[dict[str, Any]] = []
        if run.resume_step is not None and self.path.exists():
            rows, self.columns = read_rows(self.path, run.resume_step)
        self._rewrite(rows)

    def _rewrite(self, rows: list[dict[str, Any]]) -> None:
        tmp = self.path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as file:
            writer = csv.DictWriter(file, self.columns)
            writer.writeheader()
            writer.writerows(rows)
        tmp.replace(self.path)
        self._file = open(self.path, "a", newline="", encoding="utf-8")
        self._writer = csv.DictWriter(self._file, self.columns)

    def log(self, row: dict[str, Any]) -> None:
        values = {k: v for k, v in row.items() if not isinstance(v, Histogram)}
        new = [k for k in values if k not in self.columns]
        if new:
            self._file.close()
            rows, _ = read_rows(self.path, math.inf)
            self.columns += new
            self._rewrite(rows)
        self._writer.writerow(values)
        self._file.flush()

    def finish(self, summary: dict[str, Any]) -> None:
        self._file.close()

    def abandon(self) -> None:
        self._file.close()

    def state(self) -> dict[str, Any]:
        return {}


def read_rows(path: Path, up_to_step: float) -> tuple[list[dict[str, Any]], list[str]]:
    """The rows of a metrics.csv up to a step, and its columns; a torn last line is dropped."""
    with open(path, newline="", encoding="utf-8") as file:
        reader = csv.DictReader(file)
        whole = [row for row in reader if None not in row and None not in row.values() and row["step"]]
        rows = [row for row in whole if float(row["step"]) <= up_to_step]
        return rows, list(reader.fieldnames or ["step"])
