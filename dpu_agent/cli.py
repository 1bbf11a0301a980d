"""``dpu-agent``: the daemon (``serve``) and its admin verbs (``inspect``, ``check-config``,
``ingest``; ``plan`` and ``cluster`` from ``dpu_agent.admin``)."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from dpu_agent import __version__
from dpu_agent.admin import add_commands
from dpu_agent.config import DEFAULT_PATH, KEYS, LIVE_SETTINGS, UNITS, ConfigError, load
from dpu_agent.state import StateError
from dpu_agent.weights.catalog import build_catalog
from dpu_agent.weights.layouts import LayoutError
from dpu_agent.weights.safetensors_file import CheckpointError
from dpu_offload.cpus import run_on


def _config_path(arg: str | None) -> Path | None:
    if arg:
        return Path(arg)
    return DEFAULT_PATH if DEFAULT_PATH.exists() else None


def cmd_serve(args: argparse.Namespace) -> int:
    from dpu_agent.service.lifecycle import Notifier
    from dpu_agent.service.server import AgentServer

    path = _config_path(args.config)
    cfg = load(path)
    from dpu_agent.service.logs import configure

    configure(cfg.logging.format)
    if cfg.process.cpus:
        try:
            run_on(cfg.process.cpus)
        except OSError as exc:  # outside the cpuset this process was started in
            raise ConfigError([f"process.cpus: cannot run on CPUs {list(cfg.process.cpus)}: "
                               f"{exc.strerror}"]) from None
        logging.getLogger("dpu_agent").info("running on CPUs %s", list(cfg.process.cpus))
    notifier = Notifier()

    async def run() -> None:
        import faulthandler
        import signal

        faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks, for a hang
        agent = AgentServer(cfg, notifier)
        await agent.start()
        if args.ready_file:
            tmp = Path(args.ready_file + ".tmp")
            act = agent.nic.port if agent.nic is not None else 0
            tmp.write_text(f"{agent.port} {agent.metrics_port} {act}\n")
            os.replace(tmp, args.ready_file)
        loop = asyncio.get_running_loop()

        def reload() -> None:
            notifier.reloading()
            try:
                agent.reload(load(path))
            except ConfigError as exc:
                logging.getLogger("dpu_agent").error("SIGHUP: config rejected, nothing "
                                                     "changed: %s", exc)
            notifier.send("READY=1", f"STATUS={agent.status_line()}")

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(agent.stop()))
        loop.add_signal_handler(signal.SIGHUP, reload)
        await agent.wait()

    try:
        asyncio.run(run())
    finally:
        notifier.close()
    return 0


def cmd_check_config(args: argparse.Namespace) -> int:
    """Every problem of the config (exit 2), or the settings in force, section by section."""
    path = _config_path(args.file)
    cfg = load(path)
    print(f"configuration OK: {path or 'no file (defaults and DPU_AGENT_* variables)'}")
    sections: dict[str, list[str]] = {}
    for section, key in KEYS:
        value = cfg.value(section, key)
        shown = json.dumps(list(value) if isinstance(value, tuple) else value)
        notes = [n for n in (UNITS[section, key], "live" if (section, key) in LIVE_SETTINGS
                             else "") if n]
        sections.setdefault(section, []).append(
            f"  {key} = {shown}" + (f"  # {', '.join(notes)}" if notes else ""))
    for section, lines in sections.items():
        print(f"[{section}]", *lines, sep="\n")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from dpu_agent.weights.ingest import MANIFEST_FILE

    cat = build_catalog(args.dir, require_shards=False)
    first = next(iter(cat.experts.values()))
    info = {
        "architecture": cat.layout.architecture,
        "pattern": cat.layout.pattern,
        "stacked": cat.layout.stacked,
        "activation": vars(cat.layout.activation),
        "moe_layers": list(cat.layout.moe_layers),
        "experts_per_layer": cat.layout.experts_per_layer,
        "shared_experts_per_layer": cat.layout.shared_experts_per_layer,
        "expert_bytes": cat.expert_bytes,
        "total_expert_bytes": cat.total_expert_bytes,
        "bytes_from": "shard headers" if cat.shards_present else "config shapes",
        "manifest": (Path(args.dir) / MANIFEST_FILE).exists(),
        "expert_tensors": [{"name": t.role, "dtype": t.dtype, "shape": list(t.shape),
                            "offset": t.offset, "nbytes": t.nbytes} for t in first.tensors],
    }
    if args.json:
        print(json.dumps(info))
        return 0
    layers = info["moe_layers"]
    print(f"architecture      {info['architecture']}")
    print(f"experts named     {info['pattern']}")
    act = cat.layout.activation
    print(f"activation        {act.kind}" + (f" (alpha {act.alpha}, limit {act.limit})"
                                             if act.kind != "swiglu" else ""))
    print(f"ingest manifest   {'yes: fills are checked against it' if info['manifest'] else 'no'}")
    print(f"MoE layers        {len(layers)} ({layers[0]}..{layers[-1]})")
    print(f"experts / layer   {info['experts_per_layer']} routed, "
          f"{info['shared_experts_per_layer']} shared")
    print(f"expert {first.key}:")
    for t in info["expert_tensors"]:
        print(f"  {t['name']:<22} {t['dtype']:<8} {t['shape']!s:<16} {t['nbytes']:>12} B")
    print(f"bytes per expert  {info['expert_bytes']} (from {info['bytes_from']})")
    print(f"bytes, all        {info['total_expert_bytes']} "
          f"({info['total_expert_bytes'] / 1e9:.2f} GB)")
    return 0


def cmd_ingest(args: argparse.Namespace) -> int:
    from dpu_agent.weights.ingest import MANIFEST_FILE, ingest, write_manifest

    if args.chunk_bytes <= 0 or args.chunk_bytes % 16:
        raise ConfigError([f"--chunk-bytes: {args.chunk_bytes} is not a positive multiple of 16"])
    cat = build_catalog(args.dir)
    manifest = ingest(cat, args.chunk_bytes, show_progress=sys.stderr.isatty())
    args.out = args.out or str(Path(args.dir) / MANIFEST_FILE)
    write_manifest(manifest, Path(args.out))
    gb = cat.total_expert_bytes / 1e9
    print(f"ingested {len(cat.experts)} experts, {gb:.3f} GB in {manifest['seconds']:.2f} s "
          f"({gb / max(manifest['seconds'], 1e-9):.2f} GB/s) -> {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dpu-agent", description=__doc__)
    parser.add_argument("--version", action="version", version=__version__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("serve", help="run the agent")
    p.add_argument("--config", help=f"TOML file (default {DEFAULT_PATH} if present)")
    p.add_argument("--ready-file",
                   help="once serving, write 'GRPC METRICS ACTIVATIONS' ports here (atomically)")
    p.set_defaults(fn=cmd_serve)
    p = sub.add_parser("check-config", help="validate a config and list every problem")
    p.add_argument("file", nargs="?")
    p.set_defaults(fn=cmd_check_config)
    p = sub.add_parser("inspect", help="describe a checkpoint's experts (index only is enough)")
    p.add_argument("dir")
    p.add_argument("--json", action="store_true")
    p.set_defaults(fn=cmd_inspect)
    p = sub.add_parser("ingest", help="checksum every expert and write the manifests")
    p.add_argument("dir")
    p.add_argument("--out", help="manifest JSON to write (atomically; default: "
                   "dpu-manifest.json in the checkpoint, where LoadModel finds it)")
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.set_defaults(fn=cmd_ingest)
    add_commands(sub)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except ConfigError as exc:
        print(f"dpu-agent: {exc}", file=sys.stderr)
        return 2
    except (CheckpointError, LayoutError, StateError, OSError, ValueError) as exc:
        print(f"dpu-agent: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
