"""metrics.jsonl in the run dir: every row, always, whatever else logs them."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from halfprec.errors import naming
from halfprec.loggers import Histogram


class JsonlSink:
    """One JSON object per line, flushed per row so a crash loses nothing already logged."""

    def __init__(self, path: Path, resume_step: int | None = None):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        if resume_step is not None and path.exists():
            # rows logged after the checkpoint (before a kill) are logged again by the resumed run;
            # a kill mid-write can leave a torn last line, which is dropped too
            kept = [line for line in path.read_text().splitlines() if row_step(line) <= resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)
        self._file = open(path, "a", encoding="utf-8")

    def log(self, row: dict[str, Any]) -> None:
        # strict JSON (jq, JavaScript): a non-finite number is written as null
        clean = {
            k: None if isinstance(v, float) and not math.isfinite(v) else v
            for k, v in row.items()
            if not isinstance(v, Histogram)
        }
        try:
            self._file.write(json.dumps(clean, allow_nan=False) + "\n")
            self._file.flush()
        except OSError as err:  # a full disk: the error names the file (exit 6, launch/exits.py)
            raise naming(err, self.path) from None

    def finish(self, summary: dict[str, Any]) -> None:
        try:
            self._file.close()  # after a refused write, the close flushes what is left of it again
        except OSError as err:
            raise naming(err, self.path) from None

    def abandon(self) -> None:  # never called: a failure of metrics.jsonl stops the run
        pass

    def state(self) -> dict[str, Any]:
        return {}


def row_step(line: str) -> float:
    """A metrics.jsonl line's step; a torn line's is infinite (dropped on resume)."""
    try:
        return json.loads(line)["step"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return float("inf")
