"""What the test suite's time goes to, by file and by kind, from a run's `--durations=0`:

    env PYTEST_ADDOPTS=--durations=0 make test > test.log 2>&1
    .venv/bin/python tests/suite_time.py test.log     # a markdown table (docs/development.md)

A file's kind is the costliest way its tests run, read from its source: a multi-process job
(`run_job`: N JAX processes, gloo start-up each), an object-storage emulator (the `bucket`,
`gcs_server` or `s3_server` fixtures), a child interpreter (`launch`, `run_python`,
`subprocess`) or in-process only. On `make test`'s parallel workers the seconds are each
worker's, summed; a group's tests (`test_id@group`: pytest-xdist's --dist loadgroup) run
one after another on one worker, so the longest group is the least the run can take.
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
LINE = re.compile(r"^(\d+\.\d+)s (setup|call|teardown)\s+(tests/[\w/]+\.py)::(\S+?)(@[\w-]+)?$")
KINDS = (
    ("multi-process job", ("run_job(",)),
    ("object-storage emulator", ("bucket", "gcs_server", "s3_server")),
    ("child interpreter", ("launch.", "run_python", "subprocess")),
)


def kind(path: Path) -> str:
    source = path.read_text()
    for name, marks in KINDS:
        if any(mark in source for mark in marks):
            return name
    return "in-process"


def main(log: str) -> None:
    seconds: dict[str, float] = defaultdict(float)
    tests: dict[str, set[str]] = defaultdict(set)
    groups: dict[str, float] = defaultdict(float)
    for line in Path(log).read_text().splitlines():
        if found := LINE.match(line):
            took, _, file, test, group = found.groups()
            seconds[file] += float(took)
            tests[file].add(test)
            if group:
                groups[group[1:]] += float(took)
    total = sum(seconds.values())
    by_kind: dict[str, float] = defaultdict(float)
    rows = []
    for file, took in sorted(seconds.items(), key=lambda kv: -kv[1]):
        k = kind(HERE.parent / file)
        by_kind[k] += took
        rows.append(f"| `{file}` | {len(tests[file])} | {took:.0f} | {took / total:.0%} | {k} |")
    print("| kind | s | share |\n| --- | --- | --- |")
    for k, took in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"| {k} | {took:.0f} | {took / total:.0%} |")
    print(f"| all ({sum(len(t) for t in tests.values())} tests) | {total:.0f} | 100% |\n")
    print("| file | tests | s | share | kind |\n| --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    if groups:
        print("\n| group (one worker, one test after another) | s |\n| --- | --- |")
        for group, took in sorted(groups.items(), key=lambda kv: -kv[1]):
            print(f"| `{group}` | {took:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1])
