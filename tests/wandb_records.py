"""Read back a W&B offline run file (`<run dir>/wandb/offline-run-*/run-<id>.wandb`); wandb 0.31 ships no reader.

Layout, checked on files written by wandb 0.31: a 7-byte header (b":W&B", magic 0xBEE1 as u16 LE,
version 0), then LevelDB's log format in 32 KiB blocks counted from the start of the file (the
header sits in block 0). A physical record is crc32c (u32), length (u16 LE), type (FULL=1,
FIRST=2, MIDDLE=3, LAST=4) and data; a record never crosses a block end, and a block tail shorter
than 7 bytes is zero padding. Each logical record is a serialized `wandb_internal_pb2.Record`.
"""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path

from google.protobuf.message import DecodeError
from wandb.proto import wandb_internal_pb2 as pb

HEADER = b":W&B" + struct.pack("<HB", 0xBEE1, 0)
BLOCK, RECORD_HEADER = 32768, 7
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def run_files(run_dir: str | Path, wait_s: float = 10.0) -> list[Path]:
    """The `.wandb` files of every W&B run under a Hydra run dir, oldest first. W&B's own service
    process writes them, and may still be writing when an in-process `run.finish()` has returned
    (seen twice in full suites on the loaded 2-core machine: a file without its exit record, one
    without even its run record), so this waits up to `wait_s` for each to hold an exit record.
    (A process that exits tears the service down, which finishes the file first.)"""
    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    for path in files:
        deadline = time.monotonic() + wait_s
        while not _has_exit_record(path) and time.monotonic() < deadline:
            time.sleep(0.1)
    return files


def _has_exit_record(path: Path) -> bool:
    try:
        return any(r.HasField("exit") for r in records(path))
    except (ValueError, DecodeError):  # the header or the last record still being written
        return False


def records(path: str | Path) -> Iterator[pb.Record]:
    data = Path(path).read_bytes()
    if data[: len(HEADER)] != HEADER:
        raise ValueError(f"{path}: not a W&B run file (header {data[:7]!r})")
    pos, parts = len(HEADER), []
    while pos + RECORD_HEADER <= len(data):
        if BLOCK - pos % BLOCK < RECORD_HEADER:  # zero-padded block trailer
            pos += BLOCK - pos % BLOCK
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0:  # preallocated zeros at the end of a file still being written
            break
        parts.append(data[pos + RECORD_HEADER : pos + RECORD_HEADER + length])
        pos += RECORD_HEADER + length
        if kind in (FULL, LAST):
            record = pb.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record
        elif kind not in (FIRST, MIDDLE):
            raise ValueError(f"{path}: bad record type {kind} at byte {pos - length - RECORD_HEADER}")


def _items(items) -> dict:
    """`key` or `nested_key` (joined with '.') -> decoded `value_json`."""
    return {item.key or ".".join(item.nested_key): json.loads(item.value_json) for item in items}


def history(path: str | Path) -> list[dict]:
    """One dict per logged step, with W&B's own `_step`, `_runtime`, `_timestamp` keys."""
    return [_items(r.history.item) for r in records(path) if r.HasField("history")]


def summary(path: str | Path) -> dict:
    """The final summary: every summary record's updates and removals, in file order."""
    out: dict = {}
    for r in records(path):
        if r.HasField("summary"):
            out.update(_items(r.summary.update))
            for item in r.summary.remove:
                out.pop(item.key or ".".join(item.nested_key), None)
    return out


def run_info(path: str | Path) -> dict:
    """The run record: id, name, group, job_type, tags, project."""
    run = next(r.run for r in records(path) if r.HasField("run"))
    fields = {
        "id": "run_id",
        "name": "display_name",
        "group": "run_group",
        "job_type": "job_type",
        "project": "project",
    }
    return {key: getattr(run, field) for key, field in fields.items()} | {"tags": list(run.tags)}


def config(path: str | Path) -> dict:
    """The run's config: the run record's config, then any later config updates (minus `_wandb`)."""
    out: dict = {}
    for r in records(path):
        if r.HasField("run"):
            out.update(_items(r.run.config.update))
        elif r.HasField("config"):
            out.update(_items(r.config.update))
    out.pop("_wandb", None)
    return out


def exit_codes(path: str | Path) -> list[int]:
    """Exit codes of the run's exit records: `[0]` for a run that finished cleanly once."""
    return [r.exit.exit_code for r in records(path) if r.HasField("exit")]
