"""Recovery after a kill (issue 43): a GPT run under `torchrun --max-restarts 1` with
`--save X --load X`; once a checkpoint exists, rank 1 is killed with SIGKILL. Reported: the
seconds from the kill to the first step of the restarted workers (torchrun noticing, the
restart, start-up, loading the checkpoint), how many steps were redone, and what a save
costs against a step (the share of a save interval's time spent saving).

    python benchmarks/bench_recovery.py [--nproc 2] [--save-interval 50] [--kill-after 75]

It makes its own small corpus (the tests' pattern) in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "examples", "pretrain_gpt.py")


def _corpus(folder: str) -> str:
    import random

    words = "the cat sat on a mat while the dog ran after a red ball in the warm sun".split()
    rng = random.Random(0)
    path = os.path.join(folder, "corpus.jsonl")
    with open(path, "w") as f:
        for _ in range(300):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(5, 40)))
            f.write(json.dumps({"text": text}) + "\n")
    prefix = os.path.join(folder, "corpus")
    subprocess.run(
        [sys.executable, "-m", "tpcore.data.preprocess", "--input", path, "--output-prefix",
         prefix, "--append-eod"],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return prefix


def _workers(agent: int) -> dict[int, int]:
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent != agent:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except OSError:
            continue
        if b"LOCAL_RANK" in env:
            out[int(env[b"LOCAL_RANK"])] = int(pid)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--save-interval", type=int, default=50)
    p.add_argument("--kill-after", type=int, default=75, help="kill once this step is logged")
    p.add_argument("--iters", type=int, default=150)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data, ckpt = _corpus(tmp), os.path.join(tmp, "ckpt")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
               str(args.nproc), "--max-restarts", "1", SCRIPT, "--num-layers", "2",
               "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
               "--micro-batch-size", "4", "--train-iters", str(args.iters), "--lr", "3e-3",
               "--device", "cpu", "--data-path", data, "--eval-iters", "0", "--log-interval",
               "1", "--no-progress", "--tensor-parallel-size", str(args.nproc), "--save", ckpt,
               "--load", ckpt, "--save-interval", str(args.save_interval)]  # fmt: skip
        log = open(os.path.join(tmp, "out"), "w+")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
        stamps: list[tuple[float, str]] = []  # (time seen, line)
        seen = 0
        killed_at = None
        while proc.poll() is None:
            log.seek(seen)
            chunk = log.read()
            seen += len(chunk.encode())
            now = time.monotonic()
            stamps += [(now, line) for line in chunk.splitlines()]
            if killed_at is None and any(
                re.match(rf"iter\s+{args.kill_after}/", line) for _, line in stamps
            ):
                os.kill(_workers(proc.pid)[1], signal.SIGKILL)
                killed_at = time.monotonic()
            time.sleep(0.02)
        log.seek(seen)
        stamps += [(time.monotonic(), line) for line in log.read().splitlines()]
    assert proc.returncode == 0, "\n".join(line for _, line in stamps[-40:])
    resumed = next(i for i, (_, line) in enumerate(stamps) if "resumed from" in line)
    first_new = next(t for t, line in stamps[resumed:] if line.startswith("iter"))
    start = int(re.search(r"at iteration (\d+)", stamps[resumed][1]).group(1))
    last_before = max(
        int(m.group(1)) for _, line in stamps[:resumed] if (m := re.match(r"iter\s+(\d+)/", line))
    )
    step_ms = [
        float(m.group(1)) for _, line in stamps if (m := re.search(r"([\d.]+) ms/step", line))
    ]
    saves = [line for _, line in stamps if "saved checkpoint" in line]
    save_s = [float(m.group(1)) for line in saves if (m := re.search(r"in ([\d.]+) s", line))]
    step = sorted(step_ms)[len(step_ms) // 2] / 1e3
    print(
        f"{args.nproc} ranks, save every {args.save_interval} steps, killed after step "
        f"{args.kill_after} (last step logged before the restart: {last_before})"
    )
    print(f"  kill -> first new step: {first_new - killed_at:.1f} s")
    print(f"  resumed at step {start}: {last_before - start} steps redone")
    print(f"  median step {step * 1e3:.1f} ms")
    if save_s:
        share = sum(save_s) / len(save_s) / (args.save_interval * step)
        print(f"  save {sum(save_s) / len(save_s):.2f} s: {100 * share:.1f}% of an interval")
    else:
        print(f"  {len(saves)} saves (the log gives no save time)")


if __name__ == "__main__":
    main()
