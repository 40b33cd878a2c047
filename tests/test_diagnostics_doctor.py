"""`dptrain doctor` on this machine, its checks, and the communication sweep through torchrun."""

from __future__ import annotations

import json
import re

import pytest

from dptrain.diagnostics.commcheck import SIZES, slow_links
from dptrain.tools.doctor import arch_supported, check_environment, check_network
from dptrain.tools.plan.calibrate import link_from_sweep
from support.run_helpers import dptrain


@pytest.mark.timeout(60)
def test_doctor_reports_versions_devices_network_and_environment():
    r = dptrain("doctor", env={"NCCL_DEBUG": "INFO"})
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for section in ("== versions", "== devices", "== GPU topology", "== network", "== environment"):
        assert section in out
    import torch

    assert f"torch {torch.__version__}" in out and "gloo available" in out
    assert re.search(r"(gloo|nccl) will use: \S+", out)
    assert "NCCL_DEBUG=INFO" in out and "! NCCL_DEBUG=INFO logs heavily" in out  # a warning with its fix


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_doctor_warnings_name_the_fix(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "nosuchnic0")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "nosuchnic0")
    _, warnings = check_network()
    assert any("names no interface of this machine (nosuchnic0)" in w and "set it to one of" in w for w in warnings)
    monkeypatch.setenv("OMP_NUM_THREADS", "64")
    _, warnings = check_environment(nproc=4)
    assert any("OMP_NUM_THREADS=64 x 4 workers" in w for w in warnings)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_compute_capability_against_the_build_architectures():
    assert arch_supported(8, 6, ["sm_80", "sm_90"])  # same major, older minor: runs
    assert not arch_supported(9, 0, ["sm_80", "sm_86"])  # "no kernel image is available"
    assert arch_supported(9, 0, ["sm_80", "compute_80"])  # PTX is JIT-compiled for newer GPUs
    assert not arch_supported(7, 0, ["sm_80", "compute_80"])


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_slow_links_and_the_rank_they_share():
    bw = {(0, 1): 10.0, (0, 2): 10.0, (0, 3): 1.0, (1, 2): 10.0, (1, 3): 1.2, (2, 3): 0.9}
    slow, ranks = slow_links(bw)
    assert sorted(slow) == [(0, 3), (1, 3), (2, 3)] and ranks == [3]
    assert slow_links({(0, 1): 1.0}) == ([], [])


@pytest.mark.timeout(90)
def test_doctor_comm_sweeps_all_reduce_sizes_over_two_ranks(tmp_path):
    sweep = tmp_path / "comm.json"
    r = dptrain("doctor", "--comm", "--nproc-per-node", "2", "--json", str(sweep), timeout=80)
    assert r.returncode == 0, r.stderr[-3000:]
    table = r.stdout[r.stdout.index("all-reduce, 2 ranks, gloo"):]
    rows = re.findall(r"^\s+(\d+ [KM]iB)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", table, re.M)
    assert [s for s, *_ in rows] == ["4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB", "16 MiB", "64 MiB"]
    assert len(rows) == len(SIZES)
    for _, us, algbw, busbw in rows:
        assert float(us) > 0 and float(busbw) == pytest.approx(float(algbw), abs=1e-3)  # 2(n-1)/n = 1 at n=2
    assert "rank 0 (" in table and "<-> rank 1" in table
    doc = json.loads(sweep.read_text())  # what `dptrain plan --comm FILE` fits alpha and beta to
    assert doc["ranks"] == 2 and doc["backend"] == "gloo" and [row["bytes"] for row in doc["all_reduce"]] == SIZES
    assert [f"{row['seconds'] * 1e6:.1f}" for row in doc["all_reduce"]] == [us for _, us, *_ in rows]
    assert link_from_sweep(doc).bandwidth > 0


FAKE_SMI = """#!/bin/sh
case "$*" in
  *topo*) echo "        GPU0    GPU1    CPU Affinity"; echo "GPU0     X      NV18    0-15"; echo "GPU1    NV18     X      0-15" ;;
  *pcie*) echo "0, NVIDIA H100, 5, 16, 16"; echo "1, NVIDIA H100, 5, 4, 16" ;;
  *query-gpu=index,pci.bus_id*) echo "0, 00000000:18:00.0"; echo "1, 00000000:2A:00.0" ;;
  *query-compute-apps*) echo "1234, 00000000:18:00.0"; echo "1235, 00000000:18:00.0"; echo "1235, 00000000:2A:00.0" ;;
esac
"""  # noqa: E501 (the fake nvidia-smi script as a shell writes it)


@pytest.mark.fast
@pytest.mark.timeout(30)
def test_gpu_topology_pcie_width_and_gpu0_contexts_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    from dptrain.diagnostics.rss import gpu0_pids
    from dptrain.tools.doctor import check_topology

    lines, warnings = check_topology()
    assert "GPU0     X      NV18    0-15" in "\n".join(lines)
    assert "GPU 1: PCIe gen 5, link width x4 (max x16)" in lines
    assert len(warnings) == 1 and warnings[0].startswith("GPU 1 (NVIDIA H100) runs at PCIe x4 of x16")
    assert gpu0_pids() == [1234, 1235]
