"""``expertctl``: the host-side command line (checkpoints for tests and demos, agent status)."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import termios
import tty
from collections.abc import Callable, Iterator

import grpc
from rich.console import Console, Group
from rich.table import Table

from dpu_offload.cli_args import integer, non_negative, positive, seconds
from dpu_offload.v1 import agent_pb2 as pb
from host_client.admin import AgentAdmin
from host_client.checkpoints import ARCHS, CheckpointSpec, make_checkpoint
from host_client.connection import TlsFiles


def cmd_make_checkpoint(args: argparse.Namespace) -> int:
    spec = CheckpointSpec(args.arch, layers=args.layers, experts=args.experts,
                          hidden=args.hidden, intermediate=args.intermediate, dtype=args.dtype,
                          top_k=args.top_k, seed=args.seed, fused=args.fused,
                          legacy_config=args.legacy_config)
    path = make_checkpoint(args.dir, spec)
    print(f"wrote {spec.arch} checkpoint to {path}")
    return 0


def cmd_serve_experts(args: argparse.Namespace) -> int:
    """An expert worker process: one device every expert of a model is placed on, serving the
    activations the NIC steers to it, until SIGTERM / SIGINT."""
    import faulthandler
    import signal
    import threading

    from host_client import AgentClient, CpuReferenceDevice, SlotPoolSpec
    from host_client.worker import ExpertWorker

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks, for a hang
    with AgentClient(args.agent, client_name="serve-experts", tls=_tls(args)) as client:
        model = client.load_model(args.checkpoint, args.model)
        if args.device == "cuda":
            from host_client.cuda_device import CudaDevice

            device = CudaDevice(args.ordinal, mechanism="copy_engine")
        else:
            device = CpuReferenceDevice(args.ordinal)
        layers, experts = model.moe_layers, model.experts_per_layer
        dev = client.register_device(device, [SlotPoolSpec(model.expert_bytes,
                                                           experts * len(layers))])
        client.wait_placement(client.apply_placement(args.model, [
            [[dev.device_id]] * experts for _ in layers]).placement_id, args.timeout)
        worker = ExpertWorker(client, dev)
        try:
            print(f"ready: {len(layers) * experts} experts of {args.model} on device "
                  f"{dev.device_id}", flush=True)
            stop.wait()
        finally:
            worker.close()
    return 0


def render_status(st: pb.StatusResponse) -> Group:
    """One screen of the agent's state as a rich renderable."""
    hit = st.cache_hits / max(1, st.cache_hits + st.cache_misses)
    head = Table.grid(padding=(0, 2))
    head.add_row(f"agent {st.version}", f"up {st.uptime_seconds:.0f} s",
                 f"arena {st.arena_used_bytes / 2**20:.1f}/{st.arena_bytes / 2**20:.1f} MiB",
                 f"cached {st.experts_cached}", f"hit rate {hit:.1%}",
                 f"in flight {st.transfers_in_flight}")
    models = Table("model", "architecture", "experts", title="models", title_justify="left")
    for m in st.models:
        models.add_row(m.model, m.architecture, str(m.experts))
    sessions = Table("session", "client", "devices", "regions", "ready slots", "held slots",
                     "lease s", title="sessions", title_justify="left")
    for x in st.sessions:
        sessions.add_row(x.session_id, x.client_name, str(x.devices), str(x.regions),
                         str(x.slots_ready), str(x.slots_held),
                         f"{x.lease_remaining_seconds:.1f}")
    if st.other_sessions:
        sessions.caption = (f"+ {st.other_sessions} other session(s), shown to their owners "
                            "and to administrators")
    return Group(head, models, sessions)


def cmd_status(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        Console().print(render_status(admin.status()))
    return 0


INTERRUPT = "\x03"
"""What :func:`_keys` reports for Ctrl-C (SIGINT), as a terminal in raw mode would."""


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str]]:
    """Key presses on stdin while the block runs (one at a time: cbreak mode on a terminal,
    restored after); the function waits up to ``timeout`` seconds for one and returns it, ""
    for none (and for good once stdin is at its end). SIGINT, unless ignored, is a key press
    too (``INTERRUPT``): raised as KeyboardInterrupt inside a gRPC call, it can leave gRPC's
    poller to abort the process at exit."""
    import signal

    stdin = sys.stdin
    fd = stdin.fileno() if stdin is not None and not stdin.closed else -1
    saved = None
    if fd >= 0 and os.isatty(fd):
        saved = termios.tcgetattr(fd)
        tty.setcbreak(fd)
    ended = fd < 0
    interrupted = False
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)

    def on_interrupt(signum: int, frame: object) -> None:
        nonlocal interrupted
        interrupted = True

    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.SIG_IGN:
        signal.signal(signal.SIGINT, on_interrupt)
    wake_fd = signal.set_wakeup_fd(wake_w)

    def pressed(timeout: float) -> str:
        nonlocal ended
        watched = [wake_r] if ended else [fd, wake_r]
        if not interrupted:
            readable = select.select(watched, [], [], timeout)[0]
            if wake_r in readable:
                os.read(wake_r, 64)
            if not interrupted and fd in readable:
                key = os.read(fd, 1)
                ended = not key
                return key.decode(errors="replace")
        return INTERRUPT if interrupted else ""

    try:
        yield pressed
    finally:
        signal.set_wakeup_fd(wake_fd)
        if handler is not signal.SIG_IGN:
            signal.signal(signal.SIGINT, handler)
        os.close(wake_r)
        os.close(wake_w)
        if saved is not None:
            termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def cmd_top(args: argparse.Namespace) -> int:
    """The status screen every ``--interval`` s until ``q`` or Ctrl-C (or ``--iterations``)."""
    from rich.live import Live

    n = 0
    with _admin(args) as admin, _keys() as pressed, Live(
            render_status(admin.status()), refresh_per_second=4) as live:
        while args.iterations == 0 or n < args.iterations:
            if pressed(args.interval).lower() in ("q", INTERRUPT):
                break
            live.update(render_status(admin.status()))
            n += 1
    return 0


def _agent_args(p: argparse.ArgumentParser) -> None:
    """--agent and how to reach it: TLS, or mutual TLS where the agent asks for client
    certificates (docs/DEPLOY.md); plaintext without --tls-ca."""
    p.add_argument("--agent", default="127.0.0.1:50051")
    for flag, what in (("ca", "the CA that signed the agent's certificate"),
                       ("cert", "this client's certificate (mutual TLS)"),
                       ("key", "this client's key (mutual TLS)")):
        env = f"EXPERTCTL_TLS_{flag.upper()}"
        p.add_argument(f"--tls-{flag}", default=os.environ.get(env, ""),
                       help=f"PEM file: {what} (default ${env})")


def _tls(args: argparse.Namespace) -> TlsFiles | None:
    """The TLS files the command line names (None: plaintext); ValueError naming the flag
    for a file that cannot be read or a certificate without its key."""
    if not args.tls_ca:
        if args.tls_cert or args.tls_key:
            raise ValueError("--tls-cert and --tls-key need --tls-ca")
        return None
    if bool(args.tls_cert) != bool(args.tls_key):
        raise ValueError("give --tls-cert and --tls-key together (or neither)")
    for flag in ("ca", "cert", "key"):
        path = getattr(args, f"tls_{flag}")
        if path and not os.access(path, os.R_OK):
            raise ValueError(f"--tls-{flag} {path!r} is not a readable file")
    return TlsFiles(args.tls_ca, args.tls_cert, args.tls_key)


def _admin(args: argparse.Namespace) -> AgentAdmin:
    """Session-less calls to ``--agent``, over TLS where the command line asks for it, with
    the session token where the command takes one."""
    return AgentAdmin(args.agent, _tls(args), getattr(args, "session_token", ""), args.timeout)


def _session_args(p: argparse.ArgumentParser) -> None:
    """--session and its token: a command acting on a session must present its secret."""
    p.add_argument("--session", required=True, help="session id (expertctl status lists them)")
    _token_arg(p)


def _token_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--session-token", default=os.environ.get("DPU_AGENT_SESSION_TOKEN", ""),
                   help="the session's token (AgentClient.session_token; default "
                   "$DPU_AGENT_SESSION_TOKEN); status shows the sessions it owns")


def cmd_rebalance(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        r = admin.rebalance(args.session, args.model, args.replicas)
    print(f"placement {r.placement_id}: max_load_ratio {r.max_load_ratio:.4f}, "
          f"{r.copies_to_add} copies to add, {r.copies_to_drop} to drop, "
          f"{r.bytes_moved} bytes to move (progress on the session's event stream)")
    return 0


ANY_OR_INDEX = integer(-1, 2**31 - 1)
"""A flow rule's layer or expert bound: an index, or -1 for any (an ``int32`` field)."""


def cmd_flows(args: argparse.Namespace) -> int:
    with _admin(args) as admin:
        if args.flows_command == "list":
            r = admin.list_flows()
            table = Table("id", "prio", "traffic", "model", "layers", "expert", "source",
                          "action", "queues", "origin", "packets", "bytes",
                          title=f"flow table v{r.version} ({r.lookups} lookups, "
                                f"{r.misses} unmatched)", title_justify="left")
            for x in r.rules:
                layers = "any" if x.layer_min < 0 and x.layer_max < 0 else \
                    f"{max(x.layer_min, 0)}..{x.layer_max if x.layer_max >= 0 else 'end'}"
                table.add_row(str(x.rule_id), str(x.priority), x.traffic, x.model or "any",
                              layers, "any" if x.expert < 0 else str(x.expert),
                              x.source or "any", x.action, ",".join(map(str, x.queues)) or "-",
                              x.origin, str(x.packets), str(x.bytes))
            Console().print(table)
            return 0
        rule = pb.FlowRule(traffic=args.traffic, action=args.action, model=args.model,
                           layer_min=args.layer_min, layer_max=args.layer_max,
                           expert=args.expert, source=args.source, queues=args.queue,
                           priority=args.priority) if args.flows_command == "add" else None
        r = admin.apply_flows(args.session, [rule] if rule else [],
                              args.rule_ids if args.flows_command == "delete" else [])
        print(f"flow table v{r.version}" + (f", added rule {list(r.added)}" if r.added else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="expertctl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("make-checkpoint", help="write a small checkpoint in a real HF layout")
    p.add_argument("dir")
    p.add_argument("--arch", required=True, choices=ARCHS)
    p.add_argument("--layers", type=positive, default=4)
    p.add_argument("--experts", type=positive, default=8)
    p.add_argument("--hidden", type=positive, default=256)
    p.add_argument("--intermediate", type=positive, default=128)
    p.add_argument("--top-k", type=positive, default=2)
    p.add_argument("--dtype", choices=("bf16", "fp8", "f32"), default="bf16")
    p.add_argument("--seed", type=non_negative, default=0)
    p.add_argument("--fused", action="store_true",
                   help="stacked experts, as transformers 5 saves with save_original_format=False")
    p.add_argument("--legacy-config", action="store_true",
                   help="Qwen3-MoE's expert count as transformers 4 spelled it (num_experts)")
    p.set_defaults(fn=cmd_make_checkpoint)
    p = sub.add_parser("serve-experts", help="an expert worker process serving activations")
    _agent_args(p)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--ordinal", type=non_negative, default=0)
    p.add_argument("--timeout", type=seconds, default=120.0, help="seconds for the placement")
    p.set_defaults(fn=cmd_serve_experts)
    p = sub.add_parser("status", help="one screen of the agent's state")
    _agent_args(p)
    p.add_argument("--timeout", type=seconds, default=5.0)
    _token_arg(p)
    p.set_defaults(fn=cmd_status)
    p = sub.add_parser("flows", help="list, add or delete flow-steering rules")
    _agent_args(p)
    p.add_argument("--timeout", type=seconds, default=5.0)
    fsub = p.add_subparsers(dest="flows_command", required=True)
    fsub.add_parser("list")
    fa = fsub.add_parser("add")
    _session_args(fa)
    fa.add_argument("--traffic", choices=("activations", "weights"), default="activations")
    fa.add_argument("--action", choices=("forward", "to_agent", "drop", "count"),
                    required=True)
    fa.add_argument("--model", default="")
    fa.add_argument("--layer-min", type=ANY_OR_INDEX, default=-1, help="-1: any")
    fa.add_argument("--layer-max", type=ANY_OR_INDEX, default=-1, help="-1: any")
    fa.add_argument("--expert", type=ANY_OR_INDEX, default=-1, help="-1: any")
    fa.add_argument("--source", default="")
    fa.add_argument("--queue", type=integer(0, 2**32 - 1), action="append", default=[])
    fa.add_argument("--priority", type=integer(-2**31, 2**31 - 1), default=10)
    fd = fsub.add_parser("delete")
    _session_args(fd)
    fd.add_argument("rule_ids", type=integer(1, 2**64 - 1), nargs="+")
    p.set_defaults(fn=cmd_flows)
    p = sub.add_parser("top", help="the status screen, refreshed live")
    _agent_args(p)
    p.add_argument("--timeout", type=seconds, default=5.0)
    _token_arg(p)
    p.add_argument("--interval", type=seconds, default=1.0)
    p.add_argument("--iterations", type=non_negative, default=0,
                   help="stop after N refreshes (0: never)")
    p.set_defaults(fn=cmd_top)
    p = sub.add_parser("rebalance", help="re-plan a session's model from its reported routing")
    _agent_args(p)
    _session_args(p)
    p.add_argument("--model", required=True)
    p.add_argument("--replicas", type=non_negative, default=0)
    p.add_argument("--timeout", type=seconds, default=30.0)
    p.set_defaults(fn=cmd_rebalance)
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except grpc.RpcError as exc:
        print(f"expertctl: agent: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1
    except (OSError, ValueError) as exc:
        print(f"expertctl: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
