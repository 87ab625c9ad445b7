"""Collective traffic read from a compiled program's HLO text.

Used by tests (which collectives a program contains) and by ``benchmarks/comm_volume.py``
(how many bytes each device moves). Backends may split one collective into a tuple of
pieces (the CPU compiler turns a P-way all-to-all into P operands); the bytes of all pieces
are summed. Collectives over single-device groups move nothing and are left out. Note that
the CPU compiler also widens bfloat16 collectives to float32; GPU compilers do not.
"""

import re

COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (?P<shape>.+?) (?P<op>" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_LISTED_GROUPS = re.compile(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[[0-9]+,([0-9]+)\]<=")


def array_bytes(shape_text: str) -> int:
  """Total bytes of every array shape in ``shape_text`` (a shape or a tuple of shapes)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape_text):
    count = 1
    for dim in filter(None, dims.split(",")):
      count *= int(dim)
    total += count * _BYTES[dtype]
  return total


def _group_size(line: str) -> int | None:
  """Devices per replica group of a collective instruction, None if the line doesn't say."""
  listed = _LISTED_GROUPS.search(line)
  if listed:
    return max(len(group.split(",")) for group in re.findall(r"\{([0-9,]*)\}", listed[1]))
  iota = _IOTA_GROUPS.search(line)
  return int(iota[1]) if iota else None


def collectives(hlo_text: str) -> list[tuple[str, str, int]]:
  """``(op, result shape text, result bytes)`` for each collective instruction, per device."""
  found = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match and _group_size(line) != 1:
      found.append((match["op"], match["shape"], array_bytes(match["shape"])))
  return found


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Result bytes per device summed by collective kind (absent kinds are 0)."""
  totals = dict.fromkeys(COLLECTIVES, 0)
  for op, _, nbytes in collectives(hlo_text):
    totals[op] += nbytes
  return totals
