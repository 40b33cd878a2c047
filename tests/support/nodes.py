"""For tests on the two-namespace cluster (dptrain.tools.netns.Cluster): a failed test leaves no node running."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from dptrain.tools.netns import Cluster


def kill_running_nodes(c: Cluster, procs: Sequence[subprocess.Popen]) -> None:
    """Pull the plug (`Cluster.kill_node`) on node i wherever its command `procs[i]` still runs."""
    for i, p in enumerate(procs):
        if p.poll() is None:
            c.kill_node(i)
