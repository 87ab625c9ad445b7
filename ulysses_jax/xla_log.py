"""One of XLA's C++ log lines, explained in our words instead of printed as is.

XLA's rematerialisation pass warns ``Can't reduce memory use below X by rematerialization;
only reduced to Y`` when its estimate of a program's peak stays above its limit (about 95 % of
the GPU). The estimate adds buffers that live in host memory (offloaded optimizer state,
parameters, layer inputs) to those on the device, so a step with host offload that fits the
GPU with room to spare gets it too, and the line means nothing to the user.

``remat_warning_explained()`` wraps a compile: XLA writes its log to file descriptor 2 from
C++, so the descriptor is pointed at a temporary file for the duration and every line is
written back unchanged afterwards, except that warning, which becomes one line of ours (once
per process), or nothing where we lowered XLA's limit on purpose (``explain=False``: the
planner's compile under memory pressure). Other XLA warnings pass through as they were.
"""

import contextlib
import logging
import os
import re
import sys
import tempfile

_REMAT = re.compile(r"Can't reduce memory use below (\S+) .*?only reduced to (\S+)")
_log = logging.getLogger(__name__)
_explained = False


def explanation(limit: str, reached: str) -> str:
  return (f"XLA's rematerialisation could not bring its memory estimate of the step below "
          f"{limit} (it reached {reached}). The estimate adds host-offloaded buffers to those on "
          "the device, so with host offload this says little; change something (remat policy, "
          "offload, shorter rows) only if the step then runs out of device memory. `python -m "
          "ulysses_jax.aot` prints the step's device and host memory separately.")


def filter_log(text: str, explain: bool = True) -> str:
  """``text`` without XLA's rematerialisation warnings; with ``explain``, the first is
  logged as ``explanation`` (once per process)."""
  global _explained  # pylint: disable=global-statement
  kept = []
  for line in text.splitlines(keepends=True):
    found = _REMAT.search(line)
    if not found:
      kept.append(line)
    elif explain and not _explained:
      _explained = True
      _log.warning(explanation(*found.groups()))
  return "".join(kept)


@contextlib.contextmanager
def remat_warning_explained(explain: bool = True):
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
