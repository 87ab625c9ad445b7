"""Prints the slowest tests of each suite from the JUnit reports that `make test`, `make
test-slow`, `make test-gpu-compile` and `make test-newest-jax` write under runs/ci/.

Usage: python scripts/ci_times.py [--top N] [REPORT.xml ...]   (default: runs/ci/*.xml, N = 25)

Times are pytest's per-test wall times (setup + call + teardown) as the workers measured them,
so under `-n 2` they include the other worker's load, as CI sees them.
"""

import argparse
import collections
import glob
import os
import sys
import xml.etree.ElementTree as ElementTree


def test_times(report_path: str) -> dict[str, float]:
  """Wall seconds per test id (``file::name[params]``) in one JUnit report."""
  times = collections.defaultdict(float)
  for case in ElementTree.parse(report_path).getroot().iter("testcase"):
    module = case.get("classname", "").replace(".", "/")
    times[f"{module}.py::{case.get('name')}"] += float(case.get("time", 0))
  return dict(times)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--top", type=int, default=25)
  parser.add_argument("reports", nargs="*")
  args = parser.parse_args(argv)
  reports = args.reports or sorted(glob.glob("runs/ci/*.xml"))
  if not reports:
    print("no reports under runs/ci/: run `make test` (or .ci/run) first", file=sys.stderr)
    return 1
  for path in reports:
    times = test_times(path)
    suite = os.path.splitext(os.path.basename(path))[0]
    print(f"\n{suite}: {len(times)} tests, {sum(times.values()):.0f} s of test time "
          f"(summed over workers); the slowest {min(args.top, len(times))}:")
    for test, seconds in sorted(times.items(), key=lambda kv: -kv[1])[:args.top]:
      print(f"  {seconds:7.1f} s  {test}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
