"""What every benchmark records: the machine, the date, and a hash of the sources measured."""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import http.server
import json
import os
import platform
import socket
import statistics
import threading
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SOURCE_DIRS = ("gpu_kernels", "host_client", "dpu_agent", "dpu_offload", "nic", "dma_engine",
               "proto", "bench")
"""What a result's source hash covers: every package of the product (tested to be all of them)
and the benchmarks."""


def _sources() -> list[Path]:
    """The project's source files, in hashing order."""
    return [p for d in SOURCE_DIRS for p in sorted((ROOT / d).rglob("*"))
            if p.is_file() and p.suffix in (".py", ".cu", ".cuh", ".proto")
            and "results" not in p.parts]


def source_hash() -> str:
    """sha256 over the project's source files (names and contents), first 16 hex digits."""
    h = hashlib.sha256()
    for p in _sources():
        h.update(str(p.relative_to(ROOT)).encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:16]


def source_files() -> dict[str, str]:
    """Each source file (path relative to the root) -> sha256 of its contents, first 12 hex
    digits: what a result was measured with, file by file, so a report can name what changed
    since."""
    return {str(p.relative_to(ROOT)): hashlib.sha256(p.read_bytes()).hexdigest()[:12]
            for p in _sources()}


def changed_since(files: dict[str, str]) -> list[str]:
    """Paths added, removed or modified in the tree since ``files`` (a ``source_files()``)."""
    now = source_files()
    return sorted(p for p in files.keys() | now.keys() if files.get(p) != now.get(p))


AGENT_CPUS_VARIABLE = "DPU_AGENT_PROCESS_CPUS"
"""The agent's ``[process] cpus`` as the environment gives it to every agent a benchmark
starts."""


def keep_off_agent_cpus() -> None:
    """Where the environment gives the agents a benchmark starts CPUs of their own
    (``DPU_AGENT_PROCESS_CPUS``), keep this process off them: the host's inference process on
    its cores, the emulated DPU on its own, as on a BlueField."""
    from dpu_agent.config_values import parse_cpus
    from dpu_offload.cpus import run_on

    text = os.environ.get(AGENT_CPUS_VARIABLE, "")
    agent = set(parse_cpus(text))
    rest = os.sched_getaffinity(0) - agent
    if agent and not rest:
        raise SystemExit(f"{AGENT_CPUS_VARIABLE}={text} leaves this process no CPU")
    if agent:
        run_on(rest)


def machine() -> dict[str, Any]:
    info: dict[str, Any] = {"host": socket.gethostname(), "arch": platform.machine(),
                            "cpus": os.cpu_count(), "python": platform.python_version(),
                            "bench_cpus": len(os.sched_getaffinity(0)),
                            "agent_cpus": os.environ.get(AGENT_CPUS_VARIABLE, "")}
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in
                   Path("/proc/cpuinfo").read_text().splitlines() if "model name" in line)
        info["cpu"] = cpu
    except (OSError, StopIteration):
        pass
    try:
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        info["gpu"] = props["name"].decode() if isinstance(props["name"], bytes) \
            else props["name"]
        info["gpus"] = cupy.cuda.runtime.getDeviceCount()
    except Exception:  # noqa: BLE001 - no GPU is a valid machine
        info["gpu"] = None
    return info


def trace_path(text: str) -> Path:
    """An ``argparse`` type: a routing trace file (docs/LAYOUT.md), read once to refuse a
    missing or malformed one by its line before any work starts."""
    from dpu_agent.routing.traces import read_trace

    try:
        if not read_trace(text):
            raise ValueError(f"{text}: no trace steps")
    except OSError as exc:
        raise argparse.ArgumentTypeError(f"{text}: {exc.strerror}") from None
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return Path(text)


def envelope(name: str, results: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"benchmark": name, "date": dt.datetime.now(dt.timezone.utc).isoformat(),
            "source_hash": source_hash(), "source_files": source_files(), "machine": machine(),
            **extra, "results": results}


def write(name: str, data: dict[str, Any], suffix: str = "") -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}{suffix}.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    return path


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, round(q / 100 * (len(s) - 1)))]


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def figure(ncols: int = 1, size: tuple[float, float] = (6.0, 4.0)) -> tuple[Any, Any]:
    """A matplotlib figure (headless backend) with ``ncols`` axes side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(1, ncols, figsize=size)


def save_figure(fig: Any, path: Path) -> None:
    """Grid, legend and layout done by the caller; writes the PNG and frees the figure."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


CHUNK = 1 << 20
"""The Expert Kit-style baselines move weights in 1 MiB HTTP chunks."""


def chunk_server(objects: dict[str, bytes]) -> http.server.ThreadingHTTPServer:
    """Serve ``objects[name]`` at ``/name/i`` in CHUNK-byte pieces on a loopback port."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            name, _, chunk = self.path.lstrip("/").rpartition("/")
            body = objects[name][int(chunk) * CHUNK:(int(chunk) + 1) * CHUNK]
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def http_fetch(server: http.server.ThreadingHTTPServer, name: str, nbytes: int) -> bytearray:
    """Fetch an object of ``nbytes`` from :func:`chunk_server` chunk by chunk into a host
    buffer."""
    buf = bytearray(nbytes)
    port = server.server_address[1]
    for i in range(-(-nbytes // CHUNK)):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/{name}/{i}") as r:
            data = r.read()
        buf[i * CHUNK:i * CHUNK + len(data)] = data
    return buf


def host_to_device_rate(device: str, ordinal: int, nbytes: int, repeats: int = 5) -> float:
    """Bytes/s of a plain copy of ``nbytes`` into a device: pinned host memory to GPU
    ``ordinal`` (``device="cuda"``), or a host memcpy for the CPU reference device. The
    baseline that delivery, decode and multi-GPU figures are compared with."""
    import numpy as np

    if device == "cuda":
        import cupy as cp

        with cp.cuda.Device(ordinal):
            host = np.frombuffer(cp.cuda.alloc_pinned_memory(nbytes), np.uint8, nbytes)
            dev = cp.empty(nbytes, np.uint8)
            dev.set(host)
            cp.cuda.runtime.deviceSynchronize()
            t0 = time.perf_counter()
            for _ in range(repeats):
                dev.set(host)
            cp.cuda.runtime.deviceSynchronize()
    else:
        host = np.random.default_rng(0).integers(0, 255, nbytes, np.uint8)
        dev = np.empty_like(host)
        t0 = time.perf_counter()
        for _ in range(repeats):
            np.copyto(dev, host)
    return repeats * nbytes / (time.perf_counter() - t0)


def scrape(agent: Any) -> dict[str, float]:
    """The agent's ``dpu_agent_*`` metrics (an AgentProcess started with ``[metrics]``), summed
    per name and first label value: ``name`` or ``name/label``."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{agent.metrics_port}/metrics").read()
    out: dict[str, float] = {}
    for line in text.decode().splitlines():
        if line.startswith("dpu_agent_"):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0] + ("/" + name.split('"')[1] if "{" in name else "")
            out[key] = out.get(key, 0.0) + float(value)
    return out


def agent_total(agent: Any, counter: str) -> float:
    """The agent's ``counter`` so far (a full sample name, ``..._total``), summed over its
    labels."""
    return sum(v for k, v in scrape(agent).items() if k.split("/")[0] == counter)


PARKED = "dpu_agent_dataplane_parked_requests_total"
"""ACQUIREs that waited in the agent's loop for a slot to land (a prefetch's, say)."""


@dataclass(frozen=True)
class CpuSnapshot:
    """The CPU seconds each live thread of process ``pid`` had used at one moment, at
    nanosecond resolution (schedstat; /proc/PID/stat counts 10 ms ticks, too coarse for a few
    hundred MB), keyed by thread id: CPU is counted per thread between two snapshots, so a
    thread that ends in between takes only its own time with it (a sum by name would lose what
    it had used before as well, and could go negative). Reading /proc costs the reading thread
    up to milliseconds (a CUDA process has dozens of threads): of this process's calling thread
    both ends are kept, so that an interval counts none of the two snapshots' own reading.

    Attributes:
        pid: the process.
        threads: thread id -> (name, CPU seconds so far); this process's Python threads are
            named by their ``threading`` name, others by their kernel name.
        caller: this process's calling thread, when ``pid`` is this process: (thread id, its
            CPU seconds as the snapshot began, as it ended).
    """

    pid: int
    threads: dict[int, tuple[str, float]]
    caller: tuple[int, float, float] | None = None

    @classmethod
    def take(cls, pid: int) -> CpuSnapshot:
        began = time.thread_time()
        own = pid == os.getpid()
        names = {t.native_id: t.name for t in threading.enumerate()} if own else {}
        threads: dict[int, tuple[str, float]] = {}
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                ns = int((task / "schedstat").read_text().split()[0])
                tid = int(task.name)
                name = names.get(tid) or (task / "comm").read_text().strip()
            except (OSError, IndexError, ValueError):
                continue  # the thread ended meanwhile
            threads[tid] = (name, ns / 1e9)
        caller = (threading.get_native_id(), began, time.thread_time()) if own else None
        return cls(pid, threads, caller)

    def since(self, before: CpuSnapshot) -> dict[str, float]:
        """CPU seconds by thread name from ``before`` to this snapshot: each thread alive now,
        less what it had at ``before`` (a thread started since counts from zero; the calling
        thread from the end of ``before`` to the start of this one); a thread that ended in
        between is not counted."""
        out: Counter[str] = Counter()
        for tid, (name, seconds) in self.threads.items():
            if self.caller is not None and before.caller is not None \
                    and tid == self.caller[0] == before.caller[0]:
                out[name] += self.caller[1] - before.caller[2]
            else:
                out[name] += seconds - before.threads.get(tid, (name, 0.0))[1]
        return dict(out)

    def total_since(self, before: CpuSnapshot) -> float:
        """CPU seconds of the whole process from ``before`` to this snapshot (as ``since``)."""
        return sum(self.since(before).values())


def child_pids(parent: int, module: str) -> list[int]:
    """The children of ``parent`` running ``python -m module`` (the agent's DMA engine or NIC
    stand-in; two while one is being replaced)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and module.encode() in cmd:
            found.append(int(pid))
    return found


def child_pid(parent: int, module: str) -> int:
    """The first of :func:`child_pids`; 0 when there is none."""
    return next(iter(child_pids(parent, module)), 0)

