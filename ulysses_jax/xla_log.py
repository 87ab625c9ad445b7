"""XLA's C++ log lines that mean nothing to our users, explained in our words instead.

Two lines, both about host offload, are caught:

* XLA's rematerialisation pass warns ``Can't reduce memory use below X by rematerialization;
  only reduced to Y`` when its estimate of a program's peak stays above its limit (about 95 % of
  the GPU). The estimate adds buffers that live in host memory (offloaded optimizer state,
  parameters, layer inputs) to those on the device, so a step with host offload that fits the
  GPU with room to spare gets it too.
* XLA's GPU scheduler logs an error, ``gpu_hlo_schedule.cc:...] The byte size of input/output
  arguments (N) exceeds the base limit (M). This indicates an error in the calculation!``, when
  the program's inputs and outputs add up to more than its base limit (80 % of the GPU, or the
  memory the client gives XLA). It counts the inputs and outputs held in host memory too:
  compiled for an H100 (jax 0.10.2, ``tests/test_gpu_compile.py``), a step donating 100 GiB of
  pinned-host state and taking 64 MiB on the device logs N = 100.1 GiB against M = 63.3 GiB,
  and compiles to the same device temporaries as with 1 GiB of host state (which logs nothing).
  The 1-GPU configs with offloaded state have logged it (``gpu_hlo_schedule.cc:1068``, another
  jax version than 0.10.2, whose ``aot`` compiles of ``llama8b_1gpu_*`` stay under the limit:
  44.9 GiB of inputs, 42.9 of them on the host).

``xla_warnings_explained()`` wraps a compile: XLA writes its log to file descriptor 2 from C++,
so the descriptor is pointed at a temporary file for the duration and every line is written
back unchanged afterwards, except those two, each of which becomes one line of ours (once per
process), or nothing where we lowered XLA's limit on purpose (``explain=False``: the planner's
compile under memory pressure). Other XLA lines pass through as they were.
"""

import contextlib
import logging
import os
import re
import sys
import tempfile

_REMAT = re.compile(r"Can't reduce memory use below (\S+) .*?only reduced to (\S+)")
_SCHEDULE = re.compile(r"gpu_hlo_schedule\.cc:\d+\] The byte size of input/output arguments "
                       r"\((\d+)\) exceeds the base limit \((\d+)\)")
_log = logging.getLogger(__name__)
_explained: set[str] = set()  # the kinds of line explained in this process


def remat_explanation(limit: str, reached: str) -> str:
  return (f"XLA's rematerialisation could not bring its memory estimate of the step below "
          f"{limit} (it reached {reached}). The estimate adds host-offloaded buffers to those on "
          "the device, so with host offload this says little; change something (remat policy, "
          "offload, shorter rows) only if the step then runs out of device memory. `python -m "
          "ulysses_jax.aot` prints the step's device and host memory separately.")


def schedule_explanation(io_bytes: str, base_bytes: str) -> str:
  return (f"XLA's GPU scheduler logged that the step's inputs and outputs "
          f"({int(io_bytes) / 2**30:.1f} GiB) exceed its base limit "
          f"({int(base_bytes) / 2**30:.1f} GiB). It counts those kept in host memory (offloaded "
          "optimizer state and parameters) as if they were on the GPU, so a step with host "
          "offload passes its limit while the part on the GPU fits, and the compile goes on; "
          "change something only if the step then runs out of device memory. `python -m "
          "ulysses_jax.aot` prints the step's device and host memory separately.")


_LINES = {"remat": (_REMAT, remat_explanation), "schedule": (_SCHEDULE, schedule_explanation)}


def filter_log(text: str, explain: bool = True) -> str:
  """``text`` without the lines this module explains; with ``explain``, the first of each kind
  in this process is logged as its explanation."""
  kept = []
  for line in text.splitlines(keepends=True):
    kind, found = _match(line)
    if not found:
      kept.append(line)
    elif explain and kind not in _explained:
      _explained.add(kind)
      _log.warning(_LINES[kind][1](*found.groups()))
  return "".join(kept)


def _match(line: str):
  """(kind, match) of the first of ``_LINES`` that ``line`` is, else (None, None)."""
  for kind, (pattern, _) in _LINES.items():
    found = pattern.search(line)
    if found:
      return kind, found
  return None, None


@contextlib.contextmanager
def xla_warnings_explained(explain: bool = True):
  """Captures file descriptor 2 (where XLA logs) while the body runs, then writes it back
  through ``filter_log``."""
  sys.stderr.flush()
  saved = os.dup(2)
  with tempfile.TemporaryFile() as captured:
    os.dup2(captured.fileno(), 2)
    try:
      yield
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      captured.seek(0)
      sys.stderr.write(filter_log(captured.read().decode("utf-8", errors="replace"), explain))
      sys.stderr.flush()
