"""`dptrain doctor`: what this machine offers for distributed training, and what is wrong with it.

Each `check_*` function returns (lines, warnings); a warning says what is wrong and how to fix
it. GPU facts come from torch and, when installed, nvidia-smi (topology, PCIe link); without a
GPU those sections say so and the CPU/gloo path is checked. `--comm` runs the all-reduce sweep
of `commcheck.py` across ranks through torchrun.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import subprocess
import sys

import psutil
import torch
import torch.distributed as dist

from dptrain import __version__
from dptrain.config import LaunchConfig, local_world_size
from dptrain.launch import torchrun as launch

ENV_PREFIXES = ("NCCL_", "TORCH_", "OMP_", "GLOO_", "CUDA_VISIBLE_DEVICES", "MASTER_", "MKL_", "TORCHELASTIC_")
Report = tuple[list[str], list[str]]


def _smi(*args: str) -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        return subprocess.run([smi, *args], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def check_versions() -> Report:
    lines = [f"dptrain {__version__}, Python {platform.python_version()}, {platform.platform()}",
             f"torch {torch.__version__}, CUDA {torch.version.cuda or 'none (CPU build)'}"]
    warnings = []
    backends = {"gloo": dist.is_gloo_available(), "nccl": dist.is_nccl_available(), "mpi": dist.is_mpi_available()}
    lines.append("backends: " + ", ".join(f"{k} {'available' if v else 'not available'}" for k, v in backends.items()))
    if backends["nccl"] and torch.cuda.is_available():
        lines.append("NCCL " + ".".join(map(str, torch.cuda.nccl.version())))
    if not backends["gloo"]:
        warnings.append(
            "gloo is not available: CPU training and CPU collectives cannot run; install an official torch wheel"
        )
    if torch.cuda.is_available() and not backends["nccl"]:
        warnings.append(
            "GPUs are present but NCCL is not available: GPU training falls back to slow gloo; "
            "install a CUDA build of torch with NCCL"
        )
    return lines, warnings


def check_devices() -> Report:
    lines = [
        f"CPU: {os.cpu_count()} logical cores ({psutil.cpu_count(logical=False)} physical), "
        f"{psutil.virtual_memory().total / 2**30:.1f} GiB RAM"
    ]
    warnings: list[str] = []
    if not torch.cuda.is_available():
        lines.append("GPU: none visible to torch" + (" (CPU build of torch)" if torch.version.cuda is None else ""))
        if _smi("-L"):
            warnings.append(
                "nvidia-smi sees GPUs but torch does not: install a CUDA build of torch "
                "(pip install torch --index-url https://download.pytorch.org/whl/cu124) or check "
                "CUDA_VISIBLE_DEVICES"
            )
        return lines, warnings
    arch = torch.cuda.get_arch_list()
    lines.append(f"torch built for: {' '.join(arch)}")
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        cc = f"{p.major}.{p.minor}"
        lines.append(f"GPU {i}: {p.name}, compute capability {cc}, {p.total_memory / 2**30:.1f} GiB")
        if not arch_supported(p.major, p.minor, arch):
            warnings.append(
                f"GPU {i} ({p.name}) has compute capability {cc} but this torch has kernels only for "
                f"{' '.join(arch)}: expect 'no kernel image is available for execution on the device'; "
                f"install a torch build that lists sm_{p.major}{p.minor}"
            )
    return lines, warnings


def arch_supported(major: int, minor: int, arch_list: list[str]) -> bool:
    """True when torch has SASS for this capability (same major, minor <= ours) or PTX it can JIT."""
    for a in arch_list:
        kind, _, num = a.partition("_")
        if not num[:-1].isdigit():
            continue
        a_major, a_minor = int(num[:-1]), int(num[-1])
        if kind == "sm" and a_major == major and a_minor <= minor:
            return True
        if kind == "compute" and (a_major, a_minor) <= (major, minor):
            return True
    return False


def check_topology() -> Report:
    if not torch.cuda.is_available():
        return ["GPU topology: no GPU"], []
    lines, warnings = [], []
    topo = _smi("topo", "-m")
    lines += ["nvidia-smi topo -m:", *("  " + t for t in topo.splitlines())] if topo else ["nvidia-smi: not found"]
    pcie = _smi(
        "--query-gpu=index,name,pcie.link.gen.max,pcie.link.width.current,pcie.link.width.max", "--format=csv,noheader"
    )
    for line in (pcie or "").splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) != 5:
            continue
        idx, name, gen, width, width_max = parts
        lines.append(f"GPU {idx}: PCIe gen {gen}, link width x{width} (max x{width_max})")
        if width.isdigit() and width_max.isdigit() and int(width) < int(width_max):
            warnings.append(
                f"GPU {idx} ({name}) runs at PCIe x{width} of x{width_max}: it sits in a narrower slot "
                "or the link trained down; host-device copies and non-NVLink traffic are slower. "
                "Move it to a full-width slot or reseat it"
            )
    return lines, warnings


def default_route_interface() -> str | None:
    """The interface of the default IPv4 route (Linux /proc/net/route)."""
    try:
        with open("/proc/net/route") as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if len(fields) > 2 and fields[1] == "00000000":
                    return fields[0]
    except OSError:
        return None
    return None


def host_interface(host: str, addrs: dict) -> tuple[str | None, str | None]:
    """(address, interface) that `host` resolves to on this machine, as gloo picks it."""
    try:
        ip = str(socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0])
    except (OSError, IndexError):
        return None, None
    iface = next((name for name, entries in addrs.items() if any(a.address == ip for a in entries)), None)
    if iface is None and ip.startswith("127."):
        iface = next(
            (name for name, entries in addrs.items() if any(a.address.startswith("127.") for a in entries)), None
        )
    return ip, iface


def check_network() -> Report:
    addrs, stats = psutil.net_if_addrs(), psutil.net_if_stats()
    lines, warnings = ["network interfaces:"], []
    for name, entries in sorted(addrs.items()):
        ips = [a.address for a in entries if a.family in (socket.AF_INET, socket.AF_INET6)]
        st = stats.get(name)
        state = ("up" if st.isup else "down") + (f", {st.speed} Mb/s" if st and st.speed else "") if st else "?"
        lines.append(f"  {name:<12} {state:<16} {' '.join(ips)}")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    var = "NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"
    chosen = os.environ.get(var)
    if chosen:
        names = [n.strip().lstrip("=^") for n in chosen.split(",")]
        lines.append(f"{backend} will use: {chosen} (from {var})")
        missing = [n for n in names if not any(i.startswith(n) for i in addrs)]
        if missing:
            warnings.append(
                f"{var}={chosen} names no interface of this machine ({', '.join(missing)}): the "
                f"process group will fail to start; set it to one of: {', '.join(sorted(addrs))}"
            )
    else:
        host = socket.gethostname()
        ip, iface = host_interface(host, addrs)
        route = default_route_interface()
        lines.append(
            f"{backend} will use: {iface or '?'} ({ip or 'unresolved'}, the address of this host's name "
            f"{host!r}; default route via {route or 'none'}); set {var} to choose another"
        )
        if ip is None or ip.startswith("127.") or ip == "::1":
            warnings.append(
                f"this host's name {host!r} resolves to {ip or 'nothing'}: fine on one node, but other "
                f"nodes cannot reach it; for multi-node jobs set {var}={route or '<interface>'}"
            )
    return lines, warnings


def check_environment(nproc: int | None = None) -> Report:
    env = {k: v for k, v in os.environ.items() if k.startswith(ENV_PREFIXES)}
    lines = ["environment:" + ("" if env else " no NCCL_/TORCH_/OMP_/GLOO_ variables set")]
    lines += [f"  {k}={v}" for k, v in sorted(env.items())]
    warnings = []
    if env.get("TORCH_DISTRIBUTED_DEBUG") == "DETAIL":
        warnings.append(
            "TORCH_DISTRIBUTED_DEBUG=DETAIL checks every collective and slows training; unset it "
            "(or use diagnostics.check_collectives=true only while debugging)"
        )
    for key in ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE", "NCCL_SHM_DISABLE"):
        if env.get(key) == "1":
            warnings.append(f"{key}=1 turns off a fast transport; unset it unless it works around a known fault")
    if env.get("NCCL_DEBUG") in ("INFO", "TRACE"):
        warnings.append(f"NCCL_DEBUG={env['NCCL_DEBUG']} logs heavily; unset it outside debugging")
    threads = env.get("OMP_NUM_THREADS")
    cores = os.cpu_count() or 1
    if threads and threads.isdigit() and nproc and int(threads) * nproc > cores:
        warnings.append(
            f"OMP_NUM_THREADS={threads} x {nproc} workers > {cores} cores: the workers oversubscribe the CPU; "
            f"use OMP_NUM_THREADS={max(1, cores // nproc)}"
        )
    return lines, warnings


def report(nproc: int | None = None) -> tuple[str, list[str]]:
    """The whole report as text, and the warnings."""
    sections = [
        ("versions", check_versions()),
        ("devices", check_devices()),
        ("GPU topology", check_topology()),
        ("network", check_network()),
        ("environment", check_environment(nproc)),
    ]
    out, warnings = [], []
    for title, (lines, warns) in sections:
        out += [f"== {title}", *lines, ""]
        warnings += warns
    out.append("== warnings" if warnings else "== no problems found")
    out += [f"  ! {w}" for w in warnings]
    return "\n".join(out) + "\n", warnings


def run_doctor(*, comm: bool, nproc: int | None, json_path: str | None = None) -> int:
    """`dptrain doctor [--comm]`: print the report; with --comm also run the all-reduce sweep."""
    text, _ = report(nproc)
    print(text, end="", flush=True)
    if not comm:
        return 0

    n = nproc or local_world_size(LaunchConfig())
    print(f"\n== communication check: all-reduce sweep over {n} ranks (torchrun)", flush=True)
    argv = launch.torchrun_args(
        LaunchConfig(),
        nproc_per_node=n,
        module="dptrain.diagnostics.commcheck",
        module_args=["--json", os.path.abspath(json_path)] if json_path else [],
    )
    sys.stdout.flush()
    return launch.run_torchrun(argv, restarts=False)
