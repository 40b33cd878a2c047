"""A two-"host" cluster on one machine: network namespaces joined by a rate-limited veth pair.

Each node is a network namespace (`ip netns`) with its own address on one veth link, its own host
name (`unshare --uts` + `hostname hN`) and its own /etc/hosts (`/etc/netns/<ns>/hosts`, which
`ip netns exec` bind-mounts), so that torchrun's c10d rendezvous and gloo resolve every node's name
to its namespace address (with one shared host name both nodes resolve to 127.0.0.1 and the
second node waits forever). A `tc tbf` qdisc on both ends limits the link in both directions.

    with Cluster(rate="100mbit") as c:
        procs = [c.popen(i, [sys.executable, "-m", "dptrain", "run", *c.launch_overrides(i)]) for i in range(2)]

Names are unique per cluster (several may exist at once); everything is removed on exit, also at
interpreter exit (atexit) if the `with` block is skipped. Needs root, iproute2 and netns support:
`unavailable_reason()` says why not. Command line: `python -m dptrain.tools.netns up|down|run`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

NETNS_ETC = Path("/etc/netns")
SUBNET = "10.77.0"  # private to the namespaces: every cluster has its own copy of the link
RDZV_PORT = 29577


def unavailable_reason() -> str | None:
    """Why a cluster cannot be built here (None when it can): not root, no `ip`/`tc`/`unshare`, or
    the kernel refuses network namespaces."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "tc", "unshare", "hostname"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (Debian: iproute2, util-linux, hostname)"
    probe = f"dptprobe-{uuid.uuid4().hex[:8]}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip() or r.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {r.stderr.strip()}")


class Cluster:
    """`nodes` namespaces on one veth link (two nodes: a pair; the link is point-to-point), each
    end limited to `rate` (tc's units: 1gbit, 100mbit) with a token bucket of `burst`."""

    def __init__(self, *, rate: str = "1gbit", nodes: int = 2, burst: str = "256kb", latency: str = "100ms",
                 name: str | None = None) -> None:
        if nodes != 2:
            raise ValueError(f"nodes={nodes}: a veth link joins exactly two namespaces")
        self.rate, self.burst, self.latency = rate, burst, latency
        self.name = name or f"dpt{uuid.uuid4().hex[:8]}"
        self.namespaces = [f"{self.name}-n{i}" for i in range(nodes)]
        self.hostnames = [f"{self.name}-h{i}" for i in range(nodes)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(nodes)]
        self.up = False

    # ---------------------------------------------------------------- building
    def __enter__(self) -> Cluster:
        self.create()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def create(self) -> None:
        atexit.register(self.destroy)
        self.up = True
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            a, b = self.namespaces
            _ip("link", "add", "veth0", "netns", a, "type", "veth", "peer", "name", "veth1", "netns", b)
            hosts = "127.0.0.1 localhost\n" + "".join(
                f"{ip} {h}\n" for ip, h in zip(self.addresses, self.hostnames, strict=True)
            )
            for i, ns in enumerate(self.namespaces):
                dev = f"veth{i}"
                _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                self._shape(ns, dev)
                (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / ns / "hosts").write_text(hosts)
        except BaseException:
            self.destroy()
            raise

    def _shape(self, ns: str, dev: str) -> None:
        r = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "replace",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                self.rate,
                "burst",
                self.burst,
                "latency",
                self.latency,
            ],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            raise RuntimeError(f"tc tbf rate {self.rate} on {ns}/{dev} failed: {r.stderr.strip()}")

    def pids(self, node: int) -> list[int]:
        """Every process running in `node`'s namespace."""
        r = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True)
        return [int(p) for p in r.stdout.split() if p.isdigit()]

    def kill_node(self, node: int, sig: int = signal.SIGKILL) -> list[int]:
        """Pull the plug on `node`: signal every process in its namespace at once (the launcher, the
        torchrun agent and the workers, which torchrun starts in sessions of their own). The pids hit."""
        pids = self.pids(node)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        return pids

    def destroy(self) -> None:
        """Kill whatever still runs in the namespaces, delete them and their /etc/netns folders."""
        if not self.up:
            return
        self.up = False
        for i, ns in enumerate(self.namespaces):
            self.kill_node(i)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # also removes the veth pair
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        atexit.unregister(self.destroy)

    # ---------------------------------------------------------------- running
    def command(self, node: int, argv: Sequence[str]) -> list[str]:
        """`argv` as run on `node`: in its namespace, with its own UTS namespace and host name."""
        return [
            "ip",
            "netns",
            "exec",
            self.namespaces[node],
            "unshare",
            "--uts",
            "sh",
            "-c",
            'hostname "$0" && exec "$@"',
            self.hostnames[node],
            *argv,
        ]

    def popen(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen:
        """Start `argv` on `node` in a session of its own (`kill_node` ends it and everything it started)."""
        return subprocess.Popen(self.command(node, argv), start_new_session=True, **kwargs)

    def run(self, node: int, argv: Sequence[str], **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(node, argv), **kwargs)

    def rdzv_endpoint(self, port: int = RDZV_PORT) -> str:
        """Where node 0's rendezvous store listens, by host name (as a real cluster would name it)."""
        return f"{self.hostnames[0]}:{port}"

    def launch_overrides(self, node: int, *, nnodes: int | str = 2, port: int = RDZV_PORT) -> list[str]:
        """The `dptrain run` overrides that make `node` one node of a run across the cluster."""
        return [
            f"launch.nnodes={nnodes}",
            f"launch.node_rank={node}",
            f"launch.rdzv_endpoint={self.rdzv_endpoint(port)}",
            f"launch.rdzv_id={self.name}",
        ]


def dptrain_argv(items: Sequence[str]) -> list[str]:
    """`python -m dptrain run ITEMS...` with this interpreter."""
    import sys

    return [sys.executable, "-m", "dptrain", "run", *items]


def main(argv: list[str] | None = None) -> int:
    """`up` builds a cluster and prints its names (it stays until `down NAME`); `down NAME` removes
    it; `run [--rate R] -- DPTRAIN_RUN_ARGS...` runs `dptrain run ARGS` on both nodes of a fresh
    cluster (launch.nnodes/node_rank/rdzv_* added) and removes it afterwards; the exit code is the
    worst node's."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m dptrain.tools.netns")
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up")
    up.add_argument("--rate", default="1gbit")
    up.add_argument("--name")
    down = sub.add_parser("down")
    down.add_argument("name")
    run = sub.add_parser("run")
    run.add_argument("--rate", default="1gbit")
    run.add_argument("items", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    reason = unavailable_reason()
    if reason:
        print(f"netns: cannot build a cluster here: {reason}", file=sys.stderr)
        return 2
    if args.cmd == "up":
        c = Cluster(rate=args.rate, name=args.name)
        c.create()
        atexit.unregister(c.destroy)  # it outlives this command
        for i, ns in enumerate(c.namespaces):
            print(f"node {i}: netns {ns} host {c.hostnames[i]} address {c.addresses[i]} rate {c.rate}")
        print(f"rendezvous endpoint: {c.rdzv_endpoint()}; remove with: python -m dptrain.tools.netns down {c.name}")
        return 0
    if args.cmd == "down":
        c = Cluster(name=args.name)
        c.up = True
        c.destroy()
        return 0
    items = [a for a in args.items if a != "--"]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a `kill` still tears the cluster down
    with Cluster(rate=args.rate) as c:
        procs = [c.popen(i, dptrain_argv([*items, *c.launch_overrides(i)])) for i in range(2)]
        codes = [proc.wait() for proc in procs]
    print(f"netns: node exit codes {codes}", file=sys.stderr)
    return max(codes, key=abs)


if __name__ == "__main__":
    raise SystemExit(main())
