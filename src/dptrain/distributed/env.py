"""DistEnv: who this process is in the job, read from the environment torchrun (or Slurm) sets."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class DistEnv:
    """Rank layout of the current process. A process started without a launcher is rank 0 of 1."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0
    restart_count: int = 0
    max_restarts: int = 0
    """torchrun's restart budget for this worker group (0 outside torchrun): whether a failure is restarted."""
    hostname: str = ""

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that prints and writes shared files."""
        return self.rank == 0

    @property
    def launched(self) -> bool:
        """True when a launcher (torchrun) set up a rendezvous for this process."""
        return "MASTER_ADDR" in os.environ and "RANK" in os.environ

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> DistEnv:
        """Read torchrun's variables; fall back to Slurm's (srun without torchrun), then to rank 0 of 1."""
        env = os.environ if environ is None else environ

        def get(*names: str, default: int = 0) -> int:
            for n in names:
                if n in env and env[n] != "":
                    return int(env[n])
            return default

        world = get("WORLD_SIZE", "SLURM_NTASKS", default=1)
        local_world = get("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE", default=1)
        return cls(
            rank=get("RANK", "SLURM_PROCID"),
            local_rank=get("LOCAL_RANK", "SLURM_LOCALID"),
            world_size=world,
            local_world_size=local_world,
            node_rank=get("GROUP_RANK", "SLURM_NODEID"),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=get("MASTER_PORT"),
            restart_count=get("TORCHELASTIC_RESTART_COUNT"),
            max_restarts=get("TORCHELASTIC_MAX_RESTARTS"),
            hostname=socket.gethostname(),
        )
