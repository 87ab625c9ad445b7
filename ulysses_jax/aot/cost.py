"""FLOPs and memory traffic of each operation of a compiled program, read from its HLO text.

XLA's own cost analysis is unavailable on compile-only devices (``Compiled.cost_analysis()``
returns None), counts custom calls (our Pallas attention kernels, cuBLAS GEMMs) as zero FLOPs
and counts a while loop's body once however often it runs. This walk does neither:

* It visits the operations the GPU launches: the instructions of the entry computation and,
  recursively, of the bodies of while loops (weighted by XLA's ``known_trip_count``),
  conditionals (the branch with the most FLOPs, then bytes: one branch runs, and which is
  known only at run time) and calls. A fusion is one operation.
* FLOPs of an operation: 2 x (output elements) x (contracted elements) for each ``dot`` in it
  (inside a fusion's computation too, as are the custom calls below) and for cuBLAS GEMM
  custom calls; 2·R·K·N for the
  experts' grouped matmul kernels (R rows of K by N weights; ``kernels.grouped_matmul``); for
  our flash
  attention kernels, 4 (forward), 6 (dq) and 8 (dk/dv) x B x Hq x Sq x Skv x D, halved when
  causal, about W/Skv under a sliding window W (the kernels skip masked blocks; the name
  carries the window, ``..._causal_window4096``; ``reference.mean_visible_keys``).
  Elementwise work is not counted (it is bounded by memory traffic here).
* Bytes of an operation: its operands' and results' sizes (what a fusion reads from and
  writes to HBM), leaving out collectives (timed on the links instead), asynchronous copies
  (host offload: timed on PCIe from the memory analysis) and operations that move nothing
  (parameters, tuples, bitcasts, constants). An operand a fusion only slices counts the
  slices' bytes, and a dynamic-update-slice, which XLA runs in place, its update's: each step
  of a layer scan reads its layer's slice of the stacked weights and residuals and writes its
  slice of the stacked residuals, not the stacks. An asynchronous fusion (``fusion-start``,
  jax 0.11) is a fusion.
"""

import math
import re
from typing import NamedTuple

from ulysses_jax.attention.reference import mean_visible_keys
from ulysses_jax.aot.hlo import array_bytes

_INSTRUCTION = re.compile(r"^\s*(?P<root>ROOT )?%(?P<name>\S+) = (?P<shape>.+?) "
                          r"(?P<op>[a-z][a-z0-9\-]*)\((?P<operands>[^)]*)\)(?P<attrs>.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%(\S+) .*\{$")
_ARRAY = re.compile(r"\b[a-z]+[0-9]*\[([0-9,]*)\]")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_FREE = {"parameter", "tuple", "get-tuple-element", "bitcast", "constant", "after-all",
         "partition-id", "replica-id", "opt-barrier", "copy-start", "copy-done"}
_COLLECTIVE = re.compile(r"^(all-to-all|all-gather|all-reduce|reduce-scatter|"
                         r"collective-permute)(-start|-done)?$|-done$")
# Our kernels' names (a Triton pallas_call's name; a Mosaic kernel's enclosing scope).
# The kernel's name scope ends in "/" (or in ")" when a transform such as jvp wraps it).
_FLASH = re.compile(r"flash_attention_(forward|dq|dkv|dkv_dq)(_causal)?(?:_window(\d+))?[/)]")
_FLASH_FACTOR = {"forward": 4, "dq": 6, "dkv": 8, "dkv_dq": 10}  # 2x the matmuls
# The experts' grouped matmul kernels (``kernels.grouped_matmul.KERNEL_SCOPE``).
_GROUPED = re.compile(r"grouped_matmul_mosaic[/)]")


class Op(NamedTuple):
  """One operation as launched: how often per step, its FLOPs and bytes per launch."""
  name: str
  kind: str       # the HLO opcode ("fusion", "custom-call", ...)
  count: int
  flops: float
  bytes: int


def _dims(shape_text: str) -> list[int]:
  match = _ARRAY.search(shape_text)
  return [int(d) for d in match[1].split(",") if d] if match else []


def _parse(hlo_text: str) -> dict[str, list[dict]]:
  computations, name = {}, None
  for line in hlo_text.splitlines():
    header = _COMPUTATION.match(line)
    if header:
      name = "ENTRY" if line.startswith("ENTRY") else header[1]
      computations[name] = []
      continue
    match = _INSTRUCTION.match(line)
    if match and name is not None:
      computations[name].append(match.groupdict())
  return computations


class Product(NamedTuple):
  """One matrix product of a program: a dot (fused or not) or a cuBLAS GEMM."""
  name: str
  shape: str                 # the result's shape, e.g. "f32[2048,128256]{1,0}"
  operands: tuple[str, ...]  # the multiplied operands' shapes (a GEMM's first two)


def products(hlo_text: str) -> list[Product]:
  """Every dot and cuBLAS GEMM in the program's computations (fused ones included), e.g. to
  check in which precision a product runs: a float32 x float32 product runs as TF32 or FP32
  GEMMs on NVIDIA GPUs, a bfloat16 one on the bfloat16 tensor cores."""
  found = []
  for instructions in _parse(hlo_text).values():
    shapes = {i["name"]: i["shape"] for i in instructions}
    for i in instructions:
      gemm = i["op"] == "custom-call" and ("__cublas$gemm" in i["attrs"]
                                           or "__cublas$lt" in i["attrs"])
      if i["op"] == "dot" or gemm:
        operands = [o.strip().lstrip("%") for o in i["operands"].split(",")][:2]
        found.append(Product(i["name"], i["shape"], tuple(shapes.get(o, "") for o in operands)))
  return found


def _dot_flops(instruction, shapes, contracting_attr="lhs_contracting_dims"):
  contracting = re.search(contracting_attr + r"=\{([0-9,]*)\}", instruction["attrs"])
  lhs = _dims(shapes.get(instruction["operands"].split(",")[0].strip().lstrip("%"), ""))
  if not contracting or not lhs:
    return 0.0
  contracted = math.prod(lhs[int(d)] for d in contracting[1].split(",") if d)
  return 2.0 * math.prod(_dims(instruction["shape"])) * contracted


def _custom_call_flops(instruction, shapes):
  attrs = instruction["attrs"]
  if "__cublas$gemm" in attrs or "__cublas$lt" in attrs:
    dims = re.search(r'"lhs_contracting_dimensions":\["([0-9"\,]*)\]', attrs)
    lhs = _dims(shapes.get(instruction["operands"].split(",")[0].strip().lstrip("%"), ""))
    if dims and lhs:
      contracted = math.prod(lhs[int(d)] for d in dims[1].replace('"', "").split(","))
      return 2.0 * math.prod(_dims(instruction["shape"])) * contracted
  if _GROUPED.search(attrs):
    return _grouped_flops(instruction, shapes)
  flash = _FLASH.search(attrs)
  if flash:
    operands = [o.strip().lstrip("%") for o in instruction["operands"].split(",")]
    b, sq, hq, d = _dims(shapes[operands[0]])
    skv = _dims(shapes[operands[1]])[1]
    keys = mean_visible_keys(skv, flash[3] and int(flash[3])) if flash[2] else skv
    return _FLASH_FACTOR[flash[1]] * b * hq * sq * keys * d
  return 0.0


def _grouped_flops(instruction, shapes) -> float:
  """2·R·K·N of a grouped matmul kernel: ``[R, N]`` from rows ``[R, K]`` (forward, and the
  input gradient), or ``[G, K, N]`` weight gradients from ``[R, K]`` rows."""
  operands = [_dims(shapes.get(o.strip().lstrip("%"), ""))
              for o in instruction["operands"].split(",")]
  rows = next(d for d in operands if len(d) == 2)  # the [R, K] rows
  out = _dims(instruction["shape"])
  return 2.0 * rows[0] * math.prod(out[-2:] if len(out) == 3 else (rows[1], out[1]))


def _operand_names(instruction) -> list[str]:
  return re.findall(r"%([\w.\-]+)", instruction["operands"])


def _fusion_bytes(computation, computations) -> int:
  """Bytes a fusion reads and writes: each parameter whole, or only the slices taken of it, or
  nothing where it is the buffer a dynamic-update-slice at the root writes into (in place);
  each result whole, or only the update where it is such a dynamic-update-slice. Bitcasts
  move nothing: a slice of a bitcast of a parameter is a slice of the parameter."""
  instructions = computations.get(computation, [])
  by_name = {i["name"]: i for i in instructions}

  def source(name):  # the instruction a chain of bitcasts starts from
    while by_name.get(name, {}).get("op") == "bitcast":
      name = _operand_names(by_name[name])[0]
    return name

  roots = [i for i in instructions if i["root"]]
  if roots and roots[0]["op"] == "tuple":
    roots = [by_name[name] for name in _operand_names(roots[0]) if name in by_name]
  written, in_place = 0, set()
  for root in (by_name[source(r["name"])] for r in roots):
    if root["op"] == "dynamic-update-slice":
      buffer, update = _operand_names(root)[:2]
      in_place.add((source(buffer), root["name"]))
      written += array_bytes(by_name[update]["shape"])
    else:
      written += array_bytes(root["shape"])
  uses = {}
  for i in instructions:
    if i["op"] != "bitcast":
      for position, name in enumerate(_operand_names(i)):
        uses.setdefault(source(name), []).append((i, position))
  read = 0
  for parameter in (i for i in instructions if i["op"] == "parameter"):
    used = uses.get(parameter["name"], [])
    if used and all((parameter["name"], i["name"]) in in_place and position == 0
                    for i, position in used):
      continue
    if used and all(i["op"] in ("slice", "dynamic-slice") and position == 0
                    for i, position in used):
      read += sum(array_bytes(i["shape"]) for i, _ in used)
    else:
      read += array_bytes(parameter["shape"])
  return read + written


def _flops(computation, computations) -> float:
  """FLOPs of a fused computation's dots and custom calls (nested fusions included): XLA's
  dynamic-slice fusion wraps a kernel's call (jax 0.11.2 copied the attention forward so)."""
  instructions = computations.get(computation, [])
  shapes = {i["name"]: i["shape"] for i in instructions}
  total = 0.0
  for i in instructions:
    if i["op"] == "dot":
      total += _dot_flops(i, shapes)
    elif i["op"] == "custom-call":
      total += _custom_call_flops(i, shapes)
    for callee in re.findall(r"\bcalls=%([\w.\-]+)", i["attrs"]):
      total += _flops(callee, computations)
  return total


def operations(hlo_text: str) -> list[Op]:
  """Every operation the program launches per step (see the module docstring)."""
  computations = _parse(hlo_text)
  found: dict[tuple[str, str], Op] = {}

  def costliest(branches, weight):
    """The operations of the branch with the most FLOPs (then bytes)."""
    visited = []
    for branch in branches:
      ops: dict[tuple[str, str], Op] = {}
      visit(branch, weight, ops)
      visited.append(ops)
    total = lambda ops: (sum(o.count * o.flops for o in ops.values()),
                         sum(o.count * o.bytes for o in ops.values()))
    return max(visited, key=total, default={})

  def visit(computation, weight, found):
    instructions = computations.get(computation, [])
    shapes = {i["name"]: i["shape"] for i in instructions}
    for i in instructions:
      op, attrs = i["op"], i["attrs"]
      if op == "while":
        trips = _TRIP_COUNT.search(attrs)
        visit(re.search(r"\bbody=%([\w.\-]+)", attrs)[1], weight * (int(trips[1]) if trips else 1),
              found)
        continue
      if op in ("call", "conditional"):
        callees = re.findall(r"%([\w.\-]+)", " ".join(re.findall(
            r"\b(?:to_apply|calls|branch_computations|true_computation|false_computation)="
            r"(\{[^}]*\}|%[\w.\-]+)", attrs)))
        if op == "conditional":
          found.update(costliest(callees, weight))
        else:
          for callee in callees:
            visit(callee, weight, found)
        continue
      if op in _FREE or _COLLECTIVE.search(op):
        continue
      nbytes = array_bytes(i["shape"]) + sum(array_bytes(shapes.get(o, ""))
                                             for o in _operand_names(i))
      if op in ("fusion", "fusion-start"):
        callee = re.search(r"\bcalls=%([\w.\-]+)", attrs)
        flops = _flops(callee[1], computations) if callee else 0.0
        nbytes = _fusion_bytes(callee[1], computations) if callee else nbytes
      elif op == "dynamic-update-slice":  # in place: the update read and written
        flops, nbytes = 0.0, 2 * array_bytes(shapes.get(_operand_names(i)[1], ""))
      elif op == "dynamic-slice":
        flops, nbytes = 0.0, 2 * array_bytes(i["shape"])
      elif op == "custom-call":
        flops = _custom_call_flops(i, shapes)
      elif op == "dot":
        flops = _dot_flops(i, shapes)
      else:
        flops = 0.0
      key = (computation, i["name"])
      found[key] = Op(i["name"], op, weight, flops, nbytes)

  visit("ENTRY", 1, found)
  return list(found.values())
