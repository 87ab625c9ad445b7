"""Reads what an offline Weights & Biases run wrote: the history records of its ``.wandb`` file
(a LevelDB-style log: a 7-byte file header, then records in 32 KiB blocks, each chunk with a
7-byte header of CRC, length and type, holding ``wandb_internal_pb2.Record`` protos)."""

import glob
import json
import os
import struct
import time

BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def history(workdir, at_least: int = 0, timeout: float = 20) -> list[dict]:
  """The logged rows of every offline run under ``workdir/wandb``, in order, once there are
  ``at_least`` (wandb's service process writes the run file on its own, and may still be
  writing when ``finish()`` returns)."""
  deadline = time.time() + timeout
  while len(rows := _read(workdir)) < at_least and time.time() < deadline:
    time.sleep(0.1)
  return rows


def _read(workdir) -> list[dict]:
  from wandb.proto import wandb_internal_pb2 as pb
  rows = []
  for path in sorted(glob.glob(os.path.join(str(workdir), "wandb", "offline-run-*", "*.wandb"))):
    with open(path, "rb") as f:
      log = f.read()
    assert log[:4] == b":W&B", path
    pos, chunk = 7, b""
    while pos + 7 <= len(log):
      if BLOCK - pos % BLOCK < 7:  # a block's tail too short for a header is padding
        pos += BLOCK - pos % BLOCK
        continue
      _, length, kind = struct.unpack("<IHB", log[pos:pos + 7])
      if kind == 0:
        break
      chunk += log[pos + 7:pos + 7 + length]
      pos += 7 + length
      if kind in (FULL, LAST):
        record = pb.Record()
        record.ParseFromString(chunk)
        chunk = b""
        if record.WhichOneof("record_type") == "history":
          rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                       for i in record.history.item})
  return rows
