"""Where one training step's device time goes: one step under ``jax.profiler``, summed by class.

    python -m benchmarks.profile_step --preset llama3.2-1b --seq-len 65536 \\
        --run-settings configs/runs/gpu.gin --json /tmp/profile_step.json [--trace-dir DIR]

The step is ``benchmarks.train_step``'s (same flags), run twice untimed (compilation,
autotuning, allocations), then once under the profiler. The trace the profiler writes
(``DIR/plugins/profile/<run>/*.trace.json.gz``, Chrome-trace JSON, which every JAX writes
beside its ``xplane.pb``) is read with the step's optimized HLO, and each event on device 0 is
given a class (``CLASSES``):

* attention forward / backward: our kernels (the HLO op's name scope ``flash_attention_forward``
  / ``_dq`` / ``_dkv``, which the Triton and the Mosaic kernels both carry; the Triton kernels'
  names ``_forward_kernel`` / ``_dq_kernel`` / ``_dkv_kernel``, the Mosaic ones'
  ``flash_attention_forward`` / ``_dq`` / ``_dkv`` / ``_dkv_dq`` and ``decode_attention``, a
  forward), cuDNN's fused attention (fprop /
  bprop); the forward that a rematerialised layer re-runs in the backward counts as forward
  (the launch count shows it: 4 launches per layer where the backward re-runs it, 3 where not,
  2 with the dk/dv kernel accumulating dq);
* bf16 / float32 / other GEMMs: dots, cuBLAS calls and fusions holding a dot, by the dot's
  operand type (a float32 GEMM runs on TF32 tensor cores or CUDA cores: cuBLAS names it
  ``..._f32f32_tf32f32...`` or ``sgemm``);
* collectives: NCCL kernels and the HLO collectives; host transfers: host <-> device copies;
* other fusions: everything else the device runs (elementwise, reductions, copies).

On a GPU the events are the kernels on the device's streams (``/device:GPU:0``); a kernel whose
event names no HLO op takes that of the "XLA Ops" line event spanning its start. The command
runs the step without CUDA graphs (``NO_COMMAND_BUFFERS``): XLA's command buffers put every
kernel of a captured stretch under one ``command_buffer_N`` op on that line (jax 0.11.2 on an
H200, 2026-11-27: all kernels, our attention's too, fell to "other"), which would leave the
classes unknown; a step's launches cost little beside its kernels at long context. Where kernels
overlap (two streams), the overlapped time is shared equally among them, so the classes add up
to the busy time; idle = the span from the first kernel's start to the last one's end, less the
busy time. Below the classes: the kernels with the most device time, by name, HLO op and class
(``TOP_KERNELS``). On a CPU there are no device streams: the events are the host threads running
device 0's HLO ops, classed by op ("cpu: classes by op name").
"""

import argparse
import bisect
import collections
import gzip
import json
import os
import pathlib
import re
import tempfile

import jax

from benchmarks import common, train_step
from ulysses_jax.aot.hlo import COLLECTIVES

CLASSES = ("attention forward", "attention backward", "bf16 GEMMs", "float32 GEMMs",
           "other GEMMs", "other fusions", "collectives", "host transfers")
IDLE = "idle"
COLUMNS = ["class", "ms", "share_pct", "launches"]
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="
TOP_KERNELS = 15  # the longest kernels, named in the table below the classes and in the JSON

# Checked after the backward's: any other fused attention is a forward.
_ATTENTION_FORWARD = re.compile(
    r"flash_attention_forward|_forward_kernel|decode_attention|fmha|sdpa|flash_fwd", re.I)
_ATTENTION_BACKWARD = re.compile(
    r"flash_attention_(dq|dkv)|_(dq|dkv)_kernel|fmha.*(bprop|backward)|sdpa.*bprop|flash_bwd",
    re.I)
_GEMM_NAME = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|matmul", re.I)
_GEMM_TARGET = re.compile(r"gemm|matmul|cublas", re.I)
_BF16 = ("bf16", "f16")
_F32_NAME = re.compile(r"f32f32|tf32|sgemm", re.I)
_HOST_COPY_NAME = re.compile(r"memcpy\w*(htod|dtoh|h2d|d2h)|(htod|dtoh)", re.I)
_NCCL = re.compile(r"nccl", re.I)
_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?(?P<name>[\w.\-]+) = (?P<shape>.*?) (?P<op>[a-z][\w\-]*)\((?P<args>.*)$")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) .*\{\s*$")
_DTYPE = re.compile(r"\b(pred|bf16|f16|f32|f64|s4|s8|u8|s16|u16|s32|u32|s64|u64|f8e\w+)\[")
_OPERAND = re.compile(r"%([\w.\-]+)")
_CALLS = re.compile(r"\bcalls=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_OP_NAME = re.compile(r'op_name="([^"]+)"')
# Lines of a GPU's trace that repeat its kernels in other views (not launches of their own).
_DERIVED_LINES = ("XLA Modules", "XLA Ops", "TensorFlow Ops", "Steps", "Framework Name Scope",
                  "Source code", "XLA TraceMe")


def hlo_ops(hlo_text: str) -> dict:
  """``{instruction name: {"op", "shape", "target", "op_name", "gemm_dtype"}}`` of an
  optimized HLO module's text; ``gemm_dtype`` is the first operand's type of the dot the
  instruction is or holds (a fusion's computation, a cuBLAS call), else None."""
  ops, computation = {}, None
  for line in hlo_text.splitlines():
    if (match := _COMPUTATION.match(line)) and " = " not in line:
      computation = match[1]
      continue
    if not (match := _INSTRUCTION.match(line)):
      continue
    args = match["args"]
    operands = args.split("),", 1)[0]
    target, op_name = _TARGET.search(args), _OP_NAME.search(args)
    ops[match["name"]] = {
        "op": match["op"], "shape": match["shape"], "computation": computation,
        "operand_types": _DTYPE.findall(operands), "operands": _OPERAND.findall(operands),
        "target": target[1] if target else "", "op_name": op_name[1] if op_name else "",
        "callees": _CALLS.findall(args)}

  def first_operand_type(info):
    if info["operand_types"]:
      return info["operand_types"][0]
    first = ops.get(info["operands"][0]) if info["operands"] else None
    types = _DTYPE.findall(first["shape"]) if first else []
    return types[0] if types else None

  dots, calls = {}, collections.defaultdict(list)  # computation -> its dot's type; callees
  for info in ops.values():
    calls[info["computation"]] += info["callees"]
    if info["op"] in ("dot", "convolution") or (
        info["op"] == "custom-call" and _GEMM_TARGET.search(info["target"])):
      info["gemm_dtype"] = first_operand_type(info)
      dots.setdefault(info["computation"], info["gemm_dtype"])

  def dot_in(computation, seen=()):
    if computation in dots:
      return dots[computation]
    return next((d for c in calls.get(computation, ()) if c not in seen
                 for d in [dot_in(c, (*seen, computation))] if d), None)

  for info in ops.values():
    if "gemm_dtype" not in info:
      info["gemm_dtype"] = next((d for c in info["callees"] for d in [dot_in(c)] if d), None)
  return ops


def classify(name: str, info: dict | None, args_text: str = "") -> str:
  """The class (``CLASSES``) of a device event: the kernel or op ``name``, its HLO
  instruction's ``info`` (``hlo_ops``; None where the event names none) and its other
  arguments as text (a copy's direction)."""
  info = info or {}
  scope = info.get("op_name", "") + " " + info.get("target", "")
  op = info.get("op", "").removesuffix("-start").removesuffix("-done")
  if _HOST_COPY_NAME.search(name) or _HOST_COPY_NAME.search(args_text) or (
      op in ("copy", "copy-start", "dynamic-slice", "dynamic-update-slice")
      and "S(5)" in info.get("shape", "")):
    return "host transfers"
  if _NCCL.search(name) or op in COLLECTIVES:
    return "collectives"
  if _ATTENTION_BACKWARD.search(scope) or _ATTENTION_BACKWARD.search(name):
    return "attention backward"
  if _ATTENTION_FORWARD.search(scope) or _ATTENTION_FORWARD.search(name):
    return "attention forward"
  dtype = info.get("gemm_dtype")
  if dtype is None and _GEMM_NAME.search(name):
    dtype = "bf16" if "bf16" in name.lower() else "f32" if _F32_NAME.search(name) else "?"
  if dtype is None:
    return "other fusions"
  return "bf16 GEMMs" if dtype in _BF16 else "float32 GEMMs" if dtype == "f32" else "other GEMMs"


def device_events(trace: dict, device: int = 0) -> tuple[list[dict], str]:
  """The events of ``device`` in a Chrome-format trace (``traceEvents``), innermost only (an
  event enclosing another on its thread is left out for it), and how they were chosen."""
  events = trace["traceEvents"]
  processes = {e["pid"]: e["args"]["name"] for e in events
               if e.get("ph") == "M" and e.get("name") == "process_name"}
  threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
             if e.get("ph") == "M" and e.get("name") == "thread_name"}
  gpu = [pid for pid, name in processes.items() if name == f"/device:GPU:{device}"]
  spans = [e for e in events if e.get("ph") == "X" and e.get("dur") is not None]
  if gpu:
    lines = {key: name for key, name in threads.items()
             if key[0] == gpu[0] and not name.startswith(_DERIVED_LINES)}
    streams = {key for key, name in lines.items() if name.startswith("Stream")}
    chosen = [e for e in spans if (e["pid"], e["tid"]) in (streams or lines)]
    op_lines = {key for key, name in threads.items() if key[0] == gpu[0] and name == "XLA Ops"}
    _name_hlo_ops(chosen, [e for e in spans if (e["pid"], e["tid"]) in op_lines])
    mode = f"gpu: kernels on the streams of /device:GPU:{device}"
  else:
    chosen = [e for e in spans if "hlo_op" in e.get("args", {})
              and str(e["args"].get("device_ordinal", device)) == str(device)
              and not e["name"].startswith("end: ")]
    mode = "cpu: classes by op name (host threads running device 0's HLO ops)"
  return _innermost(chosen), mode


def _name_hlo_ops(kernels: list[dict], ops: list[dict]) -> None:
  """Gives each kernel event without an ``hlo_op`` argument the HLO op of the "XLA Ops" line
  event that spans its start (jax 0.11.2's GPU traces name only the kernel on the stream
  lines: an H200 profile had every kernel unclassed, 2026-11-27)."""
  ops = sorted(ops, key=lambda e: e["ts"])
  starts = [e["ts"] for e in ops]
  for kernel in kernels:
    args = kernel.setdefault("args", {})
    index = bisect.bisect_right(starts, kernel["ts"]) - 1
    if "hlo_op" not in args and index >= 0 and (
        kernel["ts"] < ops[index]["ts"] + ops[index]["dur"]):
      args["hlo_op"] = ops[index]["name"].lstrip("%").split(" = ")[0]


def _innermost(events: list[dict]) -> list[dict]:
  by_thread = collections.defaultdict(list)
  for e in events:
    by_thread[e["pid"], e["tid"]].append(e)
  kept = []
  for thread in by_thread.values():
    thread.sort(key=lambda e: (e["ts"], -e["dur"]))
    kept += [e for e, after in zip(thread, thread[1:] + [None])
             if after is None or after["ts"] >= e["ts"] + e["dur"]]
  return kept


def breakdown(events: list[dict], ops: dict) -> dict:
  """Device time by class (ms; overlapping events share their overlap equally), launches per
  class, and the span, busy and idle time (ms) of ``events``."""
  classes = [classify(e["name"], ops.get(e.get("args", {}).get("hlo_op")),
                      json.dumps(e.get("args", {}))) for e in events]
  points = sorted([(e["ts"], 1, c) for e, c in zip(events, classes)]
                  + [(e["ts"] + e["dur"], -1, c) for e, c in zip(events, classes)])
  time_us = dict.fromkeys(CLASSES, 0.0)
  active = collections.Counter()
  busy, previous = 0.0, None
  for t, change, cls in points:
    total = sum(active.values())
    if previous is not None and total and t > previous:
      busy += t - previous
      for c, n in active.items():
        time_us[c] += (t - previous) * n / total
    active[cls] += change
    previous = t
  span = (max(e["ts"] + e["dur"] for e in events) - min(e["ts"] for e in events)
          if events else 0.0)
  kernels = collections.defaultdict(lambda: {"ms": 0.0, "launches": 0})
  for e, c in zip(events, classes):
    kernel = kernels[e["name"][:100], e.get("args", {}).get("hlo_op", ""), c]
    kernel["ms"] += e["dur"] / 1e3
    kernel["launches"] += 1
  top = sorted(kernels.items(), key=lambda item: -item[1]["ms"])[:TOP_KERNELS]
  return {"ms": {c: t / 1e3 for c, t in time_us.items()},
          "launches": dict(collections.Counter(classes)), "span_ms": span / 1e3,
          "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
          "top_kernels": [{"kernel": name, "hlo_op": op, "class": c, **figures}
                          for (name, op, c), figures in top]}


def read_trace(trace_dir: str) -> dict:
  """The newest trace JSON the profiler wrote under ``trace_dir``."""
  runs = sorted((pathlib.Path(trace_dir) / "plugins" / "profile").glob("*"),
                key=os.path.getmtime)
  found = sorted(runs[-1].glob("*.trace.json.gz")) if runs else []
  if not found:
    written = [str(p) for p in pathlib.Path(trace_dir).rglob("*")]
    raise FileNotFoundError(f"no *.trace.json.gz under {trace_dir}/plugins/profile; the "
                            f"profiler wrote {written}")
  with gzip.open(found[0], "rb") as f:
    return json.load(f)


def profile(step: dict, trace_dir: str, warmup: int = 2) -> dict:
  """Runs ``step`` (``train_step.build_step``) ``warmup`` times, then once under the profiler
  into ``trace_dir``; the breakdown of device 0's time (``breakdown``) with ``mode``."""
  compiled, batch = step["compiled"], step["batch"]
  state = step["state"]
  for _ in range(warmup):
    state, _ = compiled(state, batch)
  jax.block_until_ready(state)
  with jax.profiler.trace(trace_dir):
    state, metrics = compiled(state, batch)
    jax.block_until_ready((state, metrics))
  events, mode = device_events(read_trace(trace_dir))
  result = breakdown(events, hlo_ops(compiled.as_text()))
  return {**result, "mode": mode, "events": len(events)}


def rows_of(result: dict) -> list[dict]:
  """The table: one row per class with time, then idle and the span."""
  span = result["span_ms"] or float("nan")
  rows = [{"class": c, "ms": result["ms"][c], "share_pct": 100 * result["ms"][c] / span,
           "launches": result["launches"].get(c, 0)} for c in CLASSES]
  rows.append({"class": IDLE, "ms": result["idle_ms"],
               "share_pct": 100 * result["idle_ms"] / span, "launches": None})
  rows.append({"class": "device time (span)", "ms": result["span_ms"], "share_pct": 100.0,
               "launches": result["events"]})
  return rows


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  train_step.add_step_arguments(parser)
  parser.add_argument("--trace-dir", default="",
                      help="keep the profiler's trace here (default: a temporary folder)")
  parser.add_argument("--json", default="")
  args = train_step.parse_step_arguments(parser, argv)
  step = train_step.build_step(args)
  with tempfile.TemporaryDirectory() as scratch:
    result = profile(step, args.trace_dir or scratch)
  rows = rows_of(result)
  print(f"{args.preset}, {args.seq_len:,} tokens, {jax.device_count()} x "
        f"{jax.devices()[0].device_kind}, one step after 2 untimed; {result['mode']}; busy "
        f"{result['busy_ms']:.1f} ms of {result['span_ms']:.1f} ms "
        f"({100 * result['busy_ms'] / (result['span_ms'] or float('nan')):.1f} %)")
  common.print_table(rows, COLUMNS)
  print(f"\nthe {TOP_KERNELS} kernels with the most device time (name, HLO op, class):")
  common.print_table(result["top_kernels"], ["kernel", "hlo_op", "class", "ms", "launches"])
  if args.json:
    common.write_json(args.json, rows, mode=result["mode"], span_ms=result["span_ms"],
                      busy_ms=result["busy_ms"], idle_ms=result["idle_ms"],
                      top_kernels=result["top_kernels"],
                      step={k: v for k, v in vars(args).items() if k not in ("json",)})
  return result


if __name__ == "__main__":
  # Before JAX starts its backend (the module doc: the classes need each kernel's own HLO op).
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {NO_COMMAND_BUFFERS}".strip()
  main()
