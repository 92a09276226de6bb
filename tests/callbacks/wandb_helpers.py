"""Reading back what an offline W&B run logged: its ``.wandb`` transaction log, record by record."""

from __future__ import annotations

import json
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_BLOCK = 32768
_CHUNK_HEADER = 7
_FILE_HEADER = 7


def wandb_records(path: Path) -> Iterator[Any]:
    """Records of a ``.wandb`` transaction log.

    The file is a 7-byte header (``:W&B`` and a version) followed by LevelDB log blocks of 32 KiB; each chunk has a
    7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle, 4 last) and a record may span several chunks.
    """
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, pieces = _FILE_HEADER, []
    while position + _CHUNK_HEADER <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _CHUNK_HEADER:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + _CHUNK_HEADER])
        if length == 0 and kind == 0:
            position += left
            continue
        if position + _CHUNK_HEADER + length > len(data):
            return  # a chunk still being written: the records so far (the caller waits for the record "exit")
        pieces.append(data[position + _CHUNK_HEADER : position + _CHUNK_HEADER + length])
        position += _CHUNK_HEADER + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def offline_run_rows(save_dir: Path, timeout: float = 60.0) -> list[dict[str, str]]:
    """The history rows of the single offline run under ``save_dir``, in log order: one ``key -> value_json`` dict per
    ``log`` call (``"trainer/global_step"`` is the step a ``WandbLogger`` logged it at, ``"_step"`` W&B's own count).

    ``wandb.finish()`` can return before the service has flushed the log, so this waits (up to ``timeout`` seconds)
    for the run's record ``exit``, which follows its history: the last record of the log, or (wandb 0.17) followed by
    ``stats``, ``summary``, ``final`` and ``footer``. Nested keys are joined with ``/``.
    """
    (run_file,) = Path(save_dir).glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout
    records = list(wandb_records(run_file))
    while not any(record.WhichOneof("record_type") == "exit" for record in records):
        assert time.monotonic() < deadline, f"the offline run {run_file} was never closed"
        time.sleep(0.2)
        records = list(wandb_records(run_file))
    return [
        dict(
            entry
            for item in record.history.item
            for entry in _flat(item.key or "/".join(item.nested_key), item.value_json)
        )
        for record in records
        if record.WhichOneof("record_type") == "history"
    ]


def _flat(key: str, value_json: str) -> Iterator[tuple[str, str]]:
    """``key -> value_json``, a JSON object as one entry per member (``key/member``): wandb 0.17 logs a table or an
    image as one item holding an object, later versions as one item per member."""
    value = json.loads(value_json) if value_json.startswith("{") else None
    if not isinstance(value, dict):
        yield key, value_json
        return
    for member, inner in value.items():
        yield from _flat(f"{key}/{member}", json.dumps(inner))


def offline_run_history(save_dir: Path, timeout: float = 60.0) -> dict[str, list[str]]:
    """Every history value of the single offline run under ``save_dir``: ``key -> [value_json, ...]`` in log order
    (:func:`offline_run_rows`)."""
    history: dict[str, list[str]] = {}
    for row in offline_run_rows(save_dir, timeout):
        for key, value in row.items():
            history.setdefault(key, []).append(value)
    return history
