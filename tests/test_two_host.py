"""Two "hosts" on one machine: `dptrain run` across two network namespaces over a rate-limited veth
link, one node (one worker) per namespace, through torchrun's c10d rendezvous. Needs root."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dptrain.tools.netns import Cluster, dptrain_argv, unavailable_reason
from support import ROOT
from support.run_helpers import TOY_RUN, subprocess_env

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"two-host cluster: {REASON}")
TOY = [*TOY_RUN, "train.max_steps=4", "--nproc-per-node", "1"]


def link_bytes(c: Cluster, node: int) -> int:
    """Bytes node `node` sent over its end of the veth link."""
    out = subprocess.run(["ip", "-n", c.namespaces[node], "-j", "-s", "link", "show", f"veth{node}"],
                         capture_output=True, text=True, check=True).stdout
    return int(json.loads(out)[0]["stats64"]["tx"]["bytes"])


@pytest.mark.timeout(150)
def test_dptrain_run_across_two_namespaces(tmp_path):
    out = tmp_path / "run"
    with Cluster(rate="1gbit") as c:
        procs = [c.popen(i, dptrain_argv([*TOY, *c.launch_overrides(i), "--out", str(out)]), cwd=ROOT,
                         env=subprocess_env(tests=False), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
        try:
            logs = [p.communicate(timeout=120)[0] for p in procs]
        finally:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    c.kill_node(i)
        sent = [link_bytes(c, i) for i in range(2)]
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(logs)[-6000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert len(losses) == 4 and all(loss > 0 for loss in losses)
    assert min(sent) > 10_000, f"the nodes talked over the veth link: bytes sent {sent}"  # not over a shared loopback


def test_cluster_is_removed_on_exit():
    with Cluster(rate="100mbit") as c:
        names = list(c.namespaces)
        qdisc = subprocess.run(["ip", "netns", "exec", names[0], "tc", "qdisc", "show", "dev", "veth0"],
                               capture_output=True, text=True, check=True).stdout
        assert "tbf" in qdisc and "100Mbit" in qdisc
        assert (Path("/etc/netns") / names[1] / "hosts").read_text().count(c.hostnames[1]) == 1
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in names)
    assert not any((Path("/etc/netns") / n).exists() for n in names)


@pytest.mark.timeout(200)
def test_two_host_benchmark_runs():
    """The script end to end on two of its variants (raw DDP, the reference, and one compression): each
    variant is a two-node run of its own, and the compressions themselves are tested in test_compression."""
    r = subprocess.run([sys.executable, "benchmarks/perf/two_host.py", "--rates", "100mbit", "--steps", "3",
                        "--warmup", "1",
                        "--rounds", "1", "--variant", "raw-ddp=parallel.strategy=ddp",
                        "--variant", "fp16=parallel.strategy=ddp,parallel.grad_compression=fp16"],
                       cwd=ROOT, capture_output=True, text=True, timeout=190, env=subprocess_env(tests=False))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "| 100mbit | raw-ddp |" in r.stdout and "1.00x" in r.stdout
    assert "| 100mbit | fp16 |" in r.stdout and "powersgd" not in r.stdout
