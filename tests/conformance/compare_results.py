"""Summarize and compare junit XML files written by run_torch_distributed_tests.py runs.

    python tests/conformance/compare_results.py gloo.xml tpcore.xml [--show-all]

Prints pass/fail/skip/hang counts and wall time per file, then every test whose outcome
differs between the first file (the reference, e.g. gloo) and each other one. A failure
whose message says a rank "terminated or timed out" (torch's MultiProcessTestCase killed
ranks still running at its timeout) or pytest-timeout's "Timeout" counts as a hang.
"""

from __future__ import annotations

import argparse
import re
import xml.etree.ElementTree as ET


def outcomes(path: str) -> tuple[dict[str, tuple[str, float, str]], float]:
    """test name -> (outcome, seconds, first line of the message); and the total time."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = sum(float(s.get("time", 0.0)) for s in suites)
    result: dict[str, tuple[str, float, str]] = {}
    for case in root.iter("testcase"):
        name = case.get("name")
        seconds = float(case.get("time", 0.0))
        outcome, message = "pass", ""
        for child in case:
            if child.tag in ("failure", "error"):
                text = (child.get("message") or "") + "\n" + (child.text or "")
                hang = re.search(r"terminated or timed out|Timeout \(>|Failed: Timeout", text)
                outcome = "hang" if hang else "fail"
                message = (child.get("message") or "").strip().splitlines()[:1]
                message = message[0] if message else ""
                break
            if child.tag == "skipped":
                outcome = "skip"
                message = (child.get("message") or "").strip()
        result[name] = (outcome, seconds, message)
    return result, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reference")
    parser.add_argument("others", nargs="*")
    parser.add_argument("--show-all", action="store_true", help="list every test's outcome")
    args = parser.parse_args()
    runs = {p: outcomes(p) for p in [args.reference, *args.others]}
    for path, (res, total) in runs.items():
        counts = {
            k: sum(1 for o, _, _ in res.values() if o == k)
            for k in ("pass", "fail", "hang", "skip")
        }
        print(
            f"{path}: {len(res)} tests, "
            + ", ".join(f"{k} {v}" for k, v in counts.items())
            + f", {total:.0f} s"
        )
    ref, _ = runs[args.reference]
    for path in args.others:
        res, _ = runs[path]
        print(f"\n== differences: {args.reference} -> {path}")
        for name in sorted(set(ref) | set(res)):
            a = ref.get(name, ("absent", 0.0, ""))
            b = res.get(name, ("absent", 0.0, ""))
            if a[0] != b[0]:
                print(f"{name}: {a[0]} ({a[1]:.1f} s) -> {b[0]} ({b[1]:.1f} s)  {b[2][:160]}")
    if args.show_all:
        for path, (res, _) in runs.items():
            print(f"\n== {path}")
            for name in sorted(res):
                o, s, m = res[name]
                print(f"{o:5} {s:7.1f} {name}  {m[:120]}")


if __name__ == "__main__":
    main()
