"""Two hosts on one machine: network namespaces joined by a veth pair, each process tree in
its own IPC, UTS and mount namespace with its own hostname (and an /etc/hosts naming both),
so tpcore's host identity (hostname,
boot id, IPC namespace) differs and only the network joins them, as two nodes of a
cluster. Needs root (CAP_SYS_ADMIN, CAP_NET_ADMIN) and `ip`; `unavailable()` says why not."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator

SUBNET = "10.77.{}.{}"


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=30)


def unavailable() -> str | None:
    """Why two hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    name = f"tpprobe{os.getpid() % 100000}"
    made = _run("ip", "netns", "add", name)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _run("ip", "netns", "del", name)
    veth = _run("ip", "link", "add", f"tq{os.getpid() % 100000}", "type", "veth", "peer", "name",
                f"tr{os.getpid() % 100000}")  # fmt: skip
    if veth.returncode != 0:
        return f"no veth pair: {veth.stderr.strip()}"
    _run("ip", "link", "del", f"tq{os.getpid() % 100000}")
    if _run("unshare", "--ipc", "--uts", "--mount", "true").returncode != 0:
        return "`unshare --ipc --uts --mount` is not allowed"
    return None


class Hosts:
    """Hosts 0 and 1: `address(i)`, `interface(i)`, and `command(i, argv, env)`: `argv` run
    on host i (its namespace, hostname `host{i}`)."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.namespaces = [f"tp{tag}h{i}" for i in range(2)]
        self.interfaces = [f"tp{tag}v{i}" for i in range(2)]
        self.subnet = 1 + int(tag) % 250
        self.hosts_file = f"/tmp/tpcore-two-hosts-{tag}"

    def address(self, i: int) -> str:
        return SUBNET.format(self.subnet, i + 1)

    def interface(self, i: int) -> str:
        return self.interfaces[i]

    def command(self, i: int, argv: list[str], env: dict[str, str]) -> list[str]:
        """`argv` on host i: its network namespace, new IPC, UTS and mount namespaces, the
        hostname `host{i}`, and an /etc/hosts (bind-mounted) that names both hosts."""
        assignments = [f"{k}={v}" for k, v in env.items()]
        inner = (
            f"hostname host{i} && mount --bind {self.hosts_file} /etc/hosts && exec env "
            + " ".join(assignments)
            + " "
            + " ".join(f"'{a}'" for a in argv)
        )
        return ["ip", "netns", "exec", self.namespaces[i], "unshare", "--ipc", "--uts",
                "--mount", "--", "sh", "-c", inner]  # fmt: skip

    def up(self) -> None:
        a, b = self.namespaces
        va, vb = self.interfaces
        steps = [
            ("ip", "netns", "add", a),
            ("ip", "netns", "add", b),
            ("ip", "link", "add", va, "type", "veth", "peer", "name", vb),
            ("ip", "link", "set", va, "netns", a),
            ("ip", "link", "set", vb, "netns", b),
        ]
        for i, (ns, dev) in enumerate(zip(self.namespaces, self.interfaces)):
            steps += [
                (
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "ip",
                    "addr",
                    "add",
                    f"{self.address(i)}/24",
                    "dev",
                    dev,
                ),  # fmt: skip
                ("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up"),
                ("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"),
            ]
        for step in steps:
            done = _run(*step)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(step)}: {done.stderr.strip()}")
        with open(self.hosts_file, "w") as f:
            f.write("127.0.0.1 localhost\n")
            f.writelines(f"{self.address(i)} host{i}\n" for i in range(2))

    def down(self) -> None:
        for ns in self.namespaces:  # deleting a namespace deletes its end of the pair
            _run("ip", "netns", "del", ns)
        if os.path.exists(self.hosts_file):
            os.remove(self.hosts_file)


@contextlib.contextmanager
def two_hosts() -> Iterator[Hosts]:
    hosts = Hosts(str(os.getpid() % 100000))
    try:
        hosts.up()
        yield hosts
    finally:
        hosts.down()
