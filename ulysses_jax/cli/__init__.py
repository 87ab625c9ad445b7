"""What the command lines share: argument types and writing their reports."""

import argparse
import json
import os


def json_path(text: str) -> str:
  """argparse type of ``--json``: the file's folder is made while the arguments are read, so a
  report that took minutes to measure is never lost to a missing or read-only folder."""
  folder = os.path.dirname(os.path.abspath(text))
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as e:
    raise argparse.ArgumentTypeError(f"cannot make the folder of {text}: {e}") from e
  if os.path.isdir(text) or not os.access(folder, os.W_OK):
    raise argparse.ArgumentTypeError(f"cannot write {text}: give a file path in a writable "
                                     f"folder")
  return text


def write_json(path: str, report: dict, **dump_options) -> None:
  """Writes ``report`` to ``path`` whole or not at all (a temporary file, then a rename)."""
  with open(path + ".tmp", "w", encoding="utf-8") as f:
    json.dump(report, f, indent=1, **dump_options)
  os.replace(path + ".tmp", path)
