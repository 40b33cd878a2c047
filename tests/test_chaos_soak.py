"""A short chaos soak (benchmarks/acceptance/chaos_soak.py) on the two-namespace cluster: a worker SIGKILL, a stalled
rank and a corrupted newest checkpoint under `launch.nnodes=1:2`. The world size never changes, so the final
weights and every step's loss must be bit-identical to an undisturbed run of the same seed and batch. Needs
root (network namespaces, tmpfs); the full 20-fault soak is the benchmark's own (docs/results/chaos_soak.md)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dptrain.tools.netns import unavailable_reason
from support import ROOT, subprocess_env

REASON = unavailable_reason()

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(REASON is not None, reason=f"two-host cluster: {REASON}"),
]


@pytest.mark.timeout(280)
def test_three_faults_recover_and_the_result_is_bit_identical_to_an_undisturbed_run(tmp_path):
    out = tmp_path / "soak.json"
    p = subprocess.Popen(
        [sys.executable, str(ROOT / "benchmarks" / "acceptance" / "chaos_soak.py"),
         "--plan", "worker_kill@6:1,stall@9:0,corrupt@13:1",
         "--max-steps", "20", "--keep", str(tmp_path / "work"), "--json", str(out),
         "--overrides", "checkpoint.snapshot_every_steps=0"],  # the disk path: the corrupt newest checkpoint is skipped
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=subprocess_env(tests=False), cwd=ROOT,
    )
    try:
        stdout, _ = p.communicate(timeout=250)
    except subprocess.TimeoutExpired:
        p.terminate()  # the soak tears its cluster and tmpfs down on SIGTERM
        stdout, _ = p.communicate(timeout=30)
    print(stdout)
    assert p.returncode in (0, 1), stdout[-5000:]
    report = json.loads(out.read_text())
    kinds = [f["kind"] for f in report["faults"]]
    assert kinds == ["worker_kill", "stall", "corrupt"]
    assert all(f["recovery_s"] is not None and f["recovery_s"] > 0 for f in report["faults"])
    stall = report["faults"][1]
    assert stall["steps_lost"] == 0 and stall["recovery_s"] >= stall["hold_s"]  # nothing restarted
    corrupt = report["faults"][2]
    assert corrupt["note"].startswith("corrupted checkpoints/step_")
    # the corrupted newest checkpoint was skipped: the job went back to the one before it
    corrupted_step = int(corrupt["note"].split("step_")[1].split("/")[0])
    assert corrupt["resumed_step"] < corrupted_step
    assert "skipping checkpoint" in "".join(p.read_text() for p in (tmp_path / "work" / "logs").glob("node*.log"))
    assert report["segments"] == [[20, 2]] and not report["world_size_changed"]
    cmp = report["comparison"]
    assert cmp["steps_compared"] == 20
    assert cmp["weights_bit_identical"] and cmp["losses_bit_identical"], cmp
    assert p.returncode == 0
