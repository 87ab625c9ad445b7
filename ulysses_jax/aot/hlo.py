"""Collective traffic read from a compiled program's HLO text.

Used by tests (which collectives a program contains), by ``benchmarks/comm_volume.py``
(how many bytes each device moves, ``executed_collective_bytes``) and by the roofline (what
each device sends, ``executed_collective_bytes(..., sent=True)``). Backends may split one
collective into a tuple of pieces (the CPU compiler turns a P-way all-to-all into P
operands); the bytes of all pieces are summed. Collectives over single-device groups move
nothing and are left out. Note that the CPU compiler also widens bfloat16 collectives to
float32; GPU compilers do not. GPU compilers emit asynchronous pairs (``all-to-all-start`` /
``-done``) whose start returns ``(operands, results, [sync flags])``: only the results count.
"""

import collections
import math
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
# Shardy's form (jax 0.11 on): the mesh, then the axes a group spans, a sub-axis as 'x':(k)m.
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")
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
  """The results of a collective: for an async start the tuple's elements after the
  operands, without scalar sync flags. An all-reduce start returned its results alone up to
  jax 0.10 and returns ``((operands), results)`` from jax 0.11 on: only a leading tuple of
  operands is dropped there."""
  elements = _tuple_elements(shape_text)
  if not is_start or (op == "all-reduce" and not elements[0].startswith("(")):
    return shape_text
  return ", ".join(e for e in elements[1:] if not re.fullmatch(r"u32\[\]", e))


def _group_size(line: str) -> int | None:
  """Devices per replica group of a collective instruction, None if the line doesn't say."""
  listed = _LISTED_GROUPS.search(line)
  if listed:
    return max(len(group.split(",")) for group in re.findall(r"\{([0-9,]*)\}", listed[1]))
  iota = _IOTA_GROUPS.search(line)
  if iota:
    return int(iota[1])
  mesh = _MESH_GROUPS.search(line)
  if not mesh:
    return None
  sizes = {name: int(n) for name, n in re.findall(r"'(\w+)'=(\d+)", mesh[1])}
  return math.prod(int(sub) if sub else sizes[name]
                   for name, sub in re.findall(r"'(\w+)'(?::\(\d+\)(\d+))?", mesh[2]))


# What each device of a group of n sends per byte of the collective's result, by the ring
# algorithms NCCL runs: an all-gather passes on the n-1 pieces it does not hold; a
# reduce-scatter passes n-1 partial sums of its result's size; an all-reduce is both over its
# size; an all-to-all keeps one of n pieces; a permute sends what it receives.
_SENT_PER_RESULT_BYTE = {
    "all-gather": lambda n: (n - 1) / n, "reduce-scatter": lambda n: n - 1,
    "all-reduce": lambda n: 2 * (n - 1) / n, "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1}


def _instructions(hlo_text: str) -> list[tuple[str, str, int, int | None]]:
  """``(op, result shape text, result bytes, group size)`` per collective instruction."""
  found = []
  for line in hlo_text.splitlines():
    match = _INSTRUCTION.match(line)
    if match and (group := _group_size(line)) != 1:
      shape = _result_shape(match["op"], match["shape"], bool(match["start"]))
      found.append((match["op"], shape, array_bytes(shape), group))
  return found


def collectives(hlo_text: str) -> list[tuple[str, str, int]]:
  """``(op, result shape text, result bytes)`` for each collective instruction, per device."""
  return [(op, shape, nbytes) for op, shape, nbytes, _ in _instructions(hlo_text)]


def _sent_bytes(op: str, result_bytes: int, group: int | None) -> float:
  """Bytes one device sends for a collective (``_SENT_PER_RESULT_BYTE``); its result's where
  the instruction names no groups (a permute's pairs, or all devices)."""
  return result_bytes * (_SENT_PER_RESULT_BYTE[op](group) if group else 1)


def collective_bytes(hlo_text: str) -> dict[str, int]:
  """Result bytes per device summed by collective kind (absent kinds are 0), each
  instruction once: a loop body counts once however often it runs
  (``executed_collective_bytes`` weights it)."""
  totals = dict.fromkeys(COLLECTIVES, 0)
  for op, _, nbytes in collectives(hlo_text):
    totals[op] += nbytes
  return totals


def executed_collective_bytes(hlo_text: str, sent: bool = False) -> dict[str, int]:
  """Result bytes per device summed by collective kind, counting each collective as often
  as it runs: one inside a while loop counts once per iteration. ``sent``: the bytes each
  device sends instead, by the ring algorithms (``_SENT_PER_RESULT_BYTE``; a reduce-scatter
  over 8 devices sends 7 times its result), what the links carry.

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
    for op, _, nbytes, group in _instructions("\n".join(lines[computation])):
      totals[op] += weight * (round(_sent_bytes(op, nbytes, group)) if sent else nbytes)
    for callee, trips in calls[computation]:
      visit(callee, weight * trips)

  visit("ENTRY", 1)
  return totals
