"""Collective traffic read from a compiled program's HLO text.

Used by tests (which collectives a program contains) and by ``benchmarks/comm_volume.py``
(how many bytes each device moves, ``executed_collective_bytes``). Backends may split one
collective into a tuple of pieces (the CPU compiler turns a P-way all-to-all into P
operands); the bytes of all pieces are summed. Collectives over single-device groups move
nothing and are left out. Note that the CPU compiler also widens bfloat16 collectives to
float32; GPU compilers do not. GPU compilers emit asynchronous pairs (``all-to-all-start`` /
``-done``) whose start returns ``(operands, results, [sync flags])``: only the results count.
"""

import collections
import re

COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
          "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8}
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%\S+ = (?P<shape>.+?) (?P<op>" + "|".join(COLLECTIVES)
    + r")(?P<start>-start)?\(")
_ARRAY = re.compile(r"\b(" + "|".join(_BYTES) + r")\[([0-9,]*)\]")
_LISTED_GROUPS = re.compile(r"replica_groups=\{(\{[0-9,]*\}(?:,\{[0-9,]*\})*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[[0-9]+,([0-9]+)\]<=")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_CALLEES = re.compile(r"\b(body|condition|calls|to_apply|branch_computations|true_computation|"
                      r"false_computation)=(\{[^}]*\}|%[\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def array_bytes(shape_text: str) -> int:
  """Total bytes of every array shape in ``shape_text`` (a shape or a tuple of shapes)."""
  total = 0
  for dtype, dims in _ARRAY.findall(shape_text):
    count = 1
    for dim in filter(None, dims.split(",")):
      count *= int(dim)
    total += count * _BYTES[dtype]
  return total


def _tuple_elements(shape_text: str) -> list[str]:
  """The top-level elements of a tuple shape ``(a, (b, c), d)``; ``[shape_text]`` if not one."""
  if not shape_text.startswith("("):
    return [shape_text]
  elements, depth, start = [], 0, 1
  for i, char in enumerate(shape_text):
    depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(char, 0)
    if (char == "," and depth == 1) or (char == ")" and depth == 0):
      elements.append(shape_text[start:i].strip())
      start = i + 1
  return elements


def _result_shape(op: str, shape_text: str, is_start: bool) -> str:
  """The results of a collective: for an async start (but all-reduce's, which returns its
  results alone) the tuple's elements after the operands, without scalar sync flags."""
  if not is_start or op == "all-reduce":
    return shape_text
  return ", ".join(e for e in _tuple_elements(shape_text)[1:] if not re.fullmatch(r"u32\[\]", e))


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
      shape = _result_shape(match["op"], match["shape"], bool(match["start"]))
      found.append((match["op"], shape, array_bytes(shape)))
  return found


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Result bytes per device summed by collective kind (absent kinds are 0), each
  instruction once: a loop body counts once however often it runs
  (``executed_collective_bytes`` weights it)."""
  totals = dict.fromkeys(COLLECTIVES, 0)
  for op, _, nbytes in collectives(hlo_text):
    totals[op] += nbytes
  return totals


def executed_collective_bytes(hlo_text: str) -> dict[str, int]:
  """Result bytes per device summed by collective kind, counting each collective as often
  as it runs: one inside a while loop counts once per iteration.

  Walks the calls from the entry computation (while bodies and conditions, calls,
  conditional branches, reducers), weighting each computation by the product of the trip
  counts of the loops around it, as XLA annotates them (``known_trip_count``). Limits: a loop
  whose trip count XLA does not know counts once (as in ``collective_bytes``), and every
  branch of a conditional counts as if it ran.
  """
  lines, calls, name = collections.defaultdict(list), collections.defaultdict(list), None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      name = "ENTRY" if line.startswith("ENTRY") else header[1]
      continue
    lines[name].append(line)
    trips = _TRIP_COUNT.search(line)
    for kind, callees in _CALLEES.findall(line):
      for callee in re.findall(r"%([\w.\-]+)", callees):
        calls[name].append((callee, int(trips[1]) if trips and kind == "body" else 1))
  totals = dict.fromkeys(COLLECTIVES, 0)

  def visit(computation, weight):
    for op, _, nbytes in collectives("\n".join(lines[computation])):
      totals[op] += weight * nbytes
    for callee, trips in calls[computation]:
      visit(callee, weight * trips)

  visit("ENTRY", 1)
  return totals
