"""Line coverage of tpcore per package, then each file's uncovered lines (`make coverage`).

python tools/coverage_report.py build/coverage/.coverage [--goal 90]
"""

from __future__ import annotations

import argparse
import os
from collections import defaultdict

import coverage


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data_file")
    p.add_argument(
        "--goal", type=float, default=90.0, help="percent of lines each package should reach"
    )
    args = p.parse_args()
    cov = coverage.Coverage(data_file=args.data_file)
    cov.load()
    packages: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # package -> [statements, missed]
    missing: dict[str, str] = {}
    for path in sorted(cov.get_data().measured_files()):
        parts = path.split(os.sep)
        if "tpcore" not in parts:
            continue
        rel = parts[len(parts) - 1 - parts[::-1].index("tpcore") :]
        package = "/".join(rel[:2]) if len(rel) > 2 else "tpcore (top level)"
        _, statements, _, missed, text = cov.analysis2(path)
        packages[package][0] += len(statements)
        packages[package][1] += len(missed)
        if missed:
            missing["/".join(rel)] = text
    total_statements = sum(s for s, _ in packages.values())
    total_missed = sum(m for _, m in packages.values())
    print(f"| package | lines | missed | covered | goal {args.goal:.0f}% |")
    print("|---|---|---|---|---|")

    def verdict(percent: float) -> str:
        return "met" if percent >= args.goal else "not met"

    for package, (statements, missed) in sorted(packages.items()):
        percent = 100.0 * (statements - missed) / max(statements, 1)
        print(f"| {package} | {statements} | {missed} | {percent:.1f}% | {verdict(percent)} |")
    percent = 100.0 * (total_statements - total_missed) / max(total_statements, 1)
    print(f"| all | {total_statements} | {total_missed} | {percent:.1f}% | {verdict(percent)} |")
    print("\nUncovered lines:")
    for name, text in sorted(missing.items()):
        print(f"  {name}: {text}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
