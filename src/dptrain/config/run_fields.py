"""The configuration sections about operating a run rather than what it trains: launching (`launch`), logging
(`log`), checkpoints (`checkpoint`) and diagnostics (`diagnostics`). Frozen dataclasses with one docstring per
field, like the rest of the tree (config/fields.py, which assembles `Config` and re-exports these).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LaunchConfig:
    nproc_per_node: int | str = "auto"
    """Worker processes per node: a number, or auto (every local GPU, else 2 on the CPU)."""
    nnodes: int | str = 1
    """Number of nodes: N, or an elastic range MIN:MAX (e.g. 1:2): the run goes on when nodes leave (down to MIN) or
    join (up to MAX); see "Elastic node count"."""
    node_rank: int = 0
    """This node's rank (multi-node static rendezvous)."""
    rdzv_endpoint: str | None = None
    """host:port of the rendezvous for multi-node runs (default: standalone on this node)."""
    rdzv_id: str = "dptrain"
    """Job id shared by all nodes of one run."""
    max_restarts: int = 0
    """Elastic restarts torchrun grants the worker group (on each node); a node that leaves costs each survivor one, a
    node that joins costs none."""
    rdzv_conf: str | None = None
    """torchrun's c10d rendezvous settings as key=seconds,... (join_timeout, last_call_timeout, close_timeout,
    heartbeat, keep_alive_interval, keep_alive_max_attempt, read_timeout); keys not set keep torchrun's defaults,
    except in an elastic run (nnodes MIN:MAX): last_call_timeout=2, keep_alive_interval=1, keep_alive_max_attempt=3
    (a lost node is noticed in 3 s, not 15 s, and the survivors wait 2 s, not 30 s, for more nodes)."""
    warm_workers: bool | None = None
    """Warm spares: a per-node server imports torch and dptrain once, and every worker torchrun (re)starts is forked
    from it, skipping the imports (seconds per restart). null (auto): on for Linux runs that can restart (max_restarts
    > 0 or an elastic nnodes); true: always (Linux only); false: off. See "Warm spare workers"."""


@dataclass(frozen=True)
class LogConfig:
    out_dir: str | None = None
    """Run directory (default: runs/<recipe>-<timestamp>)."""
    progress: bool = True
    """Show the live progress line on rank 0."""
    name: str = "default"
    """Recipe name used in the default run directory."""
    peak_tflops: float | None = None
    """Peak TFLOP/s per device for MFU; null: the GPU's dense datasheet peak for the compute dtype, or on CPU a measured
    fp32 matmul peak."""
    tensorboard: bool = False
    """Also write the metrics as TensorBoard scalars to RUN_DIR/tensorboard/ (rank 0; needs `pip install
    dptrain[monitor]`)."""
    prometheus_port: int = 0
    """Serve Prometheus metrics over HTTP on every rank, at this port + the rank's local rank (0: off; needs `pip
    install dptrain[monitor]`)."""
    prometheus_addr: str = "0.0.0.0"
    """Address the Prometheus exporters listen on (0.0.0.0: every interface, for a scraper on another host; 127.0.0.1:
    this host only)."""
    status_every_s: float = 1.0
    """Every rank rewrites RUN_DIR/status/rank<R>.json (step, phase, step time, memory, GPU) this often, from a
    background thread, for `dptrain top` (0: off)."""
    comm_times: bool = False
    """Also time DDP's gradient communication (`comm_s`, `exposed_comm_s` in metrics.jsonl and the summary) with a
    metered communication hook: a Python call and clock reads per gradient bucket. Off: DDP reduces with its built-in
    all-reduce, `comm_bytes` is counted from the gradients once, and the times are null. A `parallel.grad_compression`
    hook is always metered."""


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None
    """Checkpoint directory (default: `checkpoints/` inside the run directory); one `step_NNNNNN/` folder per save."""
    every_steps: int = 0
    """Save every N optimizer steps (0: only at the end of the run and on preemption)."""
    keep_last: int | None = 3
    """Keep only the newest N committed checkpoints (older committed ones are deleted); null keeps all."""
    async_save: bool = False
    """Write checkpoint files in a background thread while training continues; committed only once complete."""
    snapshot_every_steps: int | None = None
    """Also snapshot the run's state into host memory (a tmpfs folder that outlives the worker) every N optimizer
    steps, written in the background and copied to a rank of another node; after a restart the run resumes from the
    newest complete snapshot when it is at least as new as the newest disk checkpoint (0: off). Every layout: full
    files (single, ddp, zero1) or each rank's DCP shards (zero2, fsdp, hsdp, tp, pp). null (default): every step when
    the run can restart (`launch.max_restarts` > 0) and two snapshots (and a peer's replica) fit the tmpfs, widened
    to every N steps when one costs more than 3% of a step's time (measured by the run: a probe of 8 snapshots
    first); off for good (with one warning) if a snapshot cannot be written."""
    snapshot_dir: str | None = None
    """Folder for the in-memory snapshots (default `/dev/shm/dptrain`); one `<run id>/<host>/` folder per run and
    node, removed when the run ends normally."""


@dataclass(frozen=True)
class DiagnosticsConfig:
    hang_timeout_s: float | None = None
    """Seconds without progress before the watchdog writes every rank's stack, names the suspect rank(s) and ends the
    job (0: off; default: min(300, parallel.timeout_s / 2)). Must be below parallel.timeout_s."""
    desync_after_s: float = 5.0
    """A rank that has waited this many seconds in a collective compares every rank's recent collectives (torch's
    flight recorder, on by default in dptrain's workers: TORCH_FR_BUFFER_SIZE). When they certainly disagree (another
    op, shape or dtype at the same collective, or ranks blocked in collectives the others have not called), the
    watchdog ends the job at once with hang_report.txt naming the ranks, ops and lines; when a rank is merely outside
    the collective the others wait in, it prints a warning naming that rank and its line, and the job ends only at
    hang_timeout_s. 0: off (the hang report still compares the rings)."""
    collective_check_every_steps: int = 0
    """Compare every rank's recent collectives (op, shapes, dtypes per group and sequence number) every N steps,
    through the job's store, without waiting for a hang: catches a collective called with different shapes that
    completed anyway (gloo's broadcast does). A mismatch ends the job with the report. 0: off."""
    check_collectives: bool = False
    """Check that every rank calls the same collective with the same shapes (TORCH_DISTRIBUTED_DEBUG=DETAIL; slow, for
    debugging; not with ddp/zero1, whose constructor crashes under it)."""
    preflight: bool = True
    """At start, check that all ranks agree on world size, config and model (parameter names, shapes, dtypes)."""
    straggler_every_steps: int = 50
    """Compare ranks' step-time split (data, compute, waiting for others) every N steps (0: off). Only the last 10 steps
    of each N-step window are timed, each with one barrier before its synchronising backward."""
    straggler_margin: float = 0.25
    """A rank whose data + compute time exceeds the median of the other ranks by this fraction is named a straggler."""
    drift_every_steps: int = 100
    """Compare a checksum of every parameter across data-parallel replicas (the dp_replicate dimension) every N steps
    (0: off; nothing to compare under zero2/fsdp without dp_replicate > 1)."""
    nonfinite: str = "off"
    """Non-finite loss or gradient norm: skip (all ranks skip the step), error (stop naming step and rank) or off (no
    per-step check)."""
    max_consecutive_skips: int = 5
    """nonfinite=skip: stop with an error after this many consecutive skipped steps."""
    rss_every_steps: int = 50
    """Sample host RSS (and CUDA allocated/reserved/peak) on every rank every N steps (0: off)."""
    rss_window: int = 10
    """Samples in the linear fit that detects steady memory growth."""
    rss_leak_mb: float = 256.0
    """Report a leak when the fitted growth over the window exceeds this many MiB (and the fit is steady, R^2 >= 0.9).
    """
    profile_steps: str | None = None
    """Profile optimizer steps A-B (1-based, inclusive: "10-12"; one step: "10") with torch.profiler: a Chrome trace per
    rank in RUN_DIR/profile/rank<R>.json (open in chrome://tracing or Perfetto) and, at the end, a table of the top
    operations on rank 0 with communication time summed apart (also in RUN_DIR/profile/rank<R>_ops.txt). B must not
    exceed train.max_steps; null: off."""
