"""The ``elasticstore`` command line.

    elasticstore server [--host H] [--port P] [--backlog N] [--max-connections N] [--log-level L]
                        [--token-file PATH] [--allow-unauthenticated-from CIDR]...
                        [--torch-protocol {on,off}]
    elasticstore get KEY | set KEY VALUE | ls [PREFIX] | status   [--addr HOST:PORT]
                                                               [--token-file PATH]
    elasticstore status --rdzv-id ID [--rdzv-endpoint H:P] [--rdzv-backend etcd] [--json|--watch]
    elasticstore metrics --metrics-port P [--metrics-addr A] [--addr HOST:PORT]
    elasticstore stop --rdzv-id ID [--rdzv-endpoint H:P] [--rdzv-backend etcd] [--timeout S]
    elasticstore forget --rdzv-id ID [--rdzv-endpoint H:P] [--rdzv-backend etcd] [--force]

``server`` prints ``elasticstore server listening on H:P`` once it accepts connections and serves
until SIGINT or SIGTERM. The client commands talk to ``--addr`` (default: ``$ELASTICSTORE_ADDR``,
else ``127.0.0.1:29400``). The token (docs/authentication.md): ``--token-file``, else the file
named by ``$ELASTICSTORE_TOKEN_FILE``, else ``$ELASTICSTORE_TOKEN``, else none. Text that comes
from the store (``ls``'s keys, ``status``'s table) shows control characters as escapes (``\\x1b``),
so a key or record cannot drive the terminal; ``get`` writes the value's bytes as they are.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence

from torch.distributed.elastic.rendezvous import RendezvousError

from .rendezvous import registry
from .stores.native.server_limits import add_limit_flags, limits_from_args

__all__ = ["main"]

DEFAULT_ADDR = "127.0.0.1:29400"
_LOG_LEVELS = ("debug", "info", "warning", "error", "off")


def _port(text: str) -> int:
    try:
        port = int(text, 10)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text} is not a port number (0..65535)")
    return port


def _int_at_least(minimum: int, what: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text} is not {what}")
        return value

    return parse


def _addr(text: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port``."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"{text} is not HOST:PORT")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    try:
        number = _port(port)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text}: {port} is not a port number (0..65535)") from None
    return host, number


_TOKEN_HELP = (
    "file holding the shared token (default: $ELASTICSTORE_TOKEN_FILE's file, else "
    "$ELASTICSTORE_TOKEN, else none)"
)


def _cidr(text: str) -> str:
    import ipaddress

    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an IPv4/IPv6 address or CIDR") from None
    return text


def _token(args: argparse.Namespace) -> str | None:
    from .stores.native.token import read_token_file

    return read_token_file(args.token_file) if args.token_file else None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="elasticstore", description="elasticstore: a key-value store for torch.distributed"
    )
    client = argparse.ArgumentParser(add_help=False)
    client.add_argument(
        "--addr",
        type=_addr,
        default=os.environ.get("ELASTICSTORE_ADDR", DEFAULT_ADDR),
        help="server HOST:PORT (default: $ELASTICSTORE_ADDR or %(default)s)",
    )
    client.add_argument("--timeout", type=float, default=10.0, help="seconds (default 10)")
    client.add_argument("--token-file", help=_TOKEN_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    server = sub.add_parser("server", help="run a store server until SIGINT/SIGTERM")
    server.add_argument("--host", default="127.0.0.1",
                        help="address or host name to bind (a name is looked up forward once)")
    server.add_argument("--port", type=_port, default=29400, help="0 picks a free port")
    server.add_argument(
        "--backlog", type=_int_at_least(0, "a backlog >= 0"), default=0, help="0: somaxconn"
    )
    server.add_argument(
        "--max-connections", type=_int_at_least(1, "a connection count >= 1"), default=65536
    )
    server.add_argument("--log-level", choices=_LOG_LEVELS, default="warning")
    server.add_argument("--token-file", help=_TOKEN_HELP)
    server.add_argument(
        "--allow-unauthenticated-from",
        action="append",
        default=[],
        type=_cidr,
        metavar="CIDR",
        help="with a token, also serve torch's unauthenticated TCPStore protocol to peers in this "
        "IPv4/IPv6 range (repeatable; loopback processes of the server's user and peers the job "
        "allows are always served)",
    )
    server.add_argument(
        "--torch-protocol", choices=("on", "off"), default="on",
        help="with a token, 'off' refuses torch's TCPStore protocol from every peer (a rendezvous "
        "endpoint: only agents, native clients, use it)",
    )
    server.add_argument("--metrics-port", type=_port, default=None,
                        help="also serve the server's counters as Prometheus text on this port")
    server.add_argument("--metrics-addr", default="127.0.0.1",
                        help="--metrics-port: numeric address to bind (default %(default)s)")
    add_limit_flags(server)

    get = sub.add_parser("get", parents=[client], help="print a key's value (exit 1 when missing)")
    get.add_argument("key")
    put = sub.add_parser("set", parents=[client], help="set a key")
    put.add_argument("key")
    put.add_argument("value")
    ls = sub.add_parser("ls", parents=[client], help="list keys under a prefix")
    ls.add_argument("prefix", nargs="?", default="")
    job = argparse.ArgumentParser(add_help=False)
    job.add_argument("--rdzv-id", "--rdzv_id", default=None, help="the job's run id")
    job.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default=None,
                     help="the rendezvous store (default: --addr); etcd: comma-separated members")
    job.add_argument("--rdzv-backend", "--rdzv_backend", default="elasticstore",
                     choices=registry.job_backends())
    job.add_argument("--etcd-prefix", default="/elasticstore/rdzv", help="etcd: key prefix")
    for flag in ("--cacert", "--cert", "--key", "--user", "--password"):
        job.add_argument(flag, default=None, help="etcd: TLS / authentication")
    status = sub.add_parser("status", parents=[client, job],
                            help="the server's counters, or a job's state with --rdzv-id")
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.add_argument("--watch", action="store_true",
                        help="refresh until Ctrl-C (a live table on a terminal with rich installed)")
    status.add_argument("--interval", type=float, default=2.0, help="--watch: seconds")
    sub.add_parser("stop", parents=[client, job],
                   help="stop a job: close its rendezvous; every agent stops its workers")
    forget = sub.add_parser("forget", parents=[client, job],
                            help="delete every key of a finished or stopped job, so its run id "
                            "can be used again")
    forget.add_argument("--force", action="store_true",
                        help="also while agents of the job are alive")
    metrics = sub.add_parser("metrics", parents=[client],
                             help="serve a store server's counters as Prometheus text")
    metrics.add_argument("--metrics-port", type=_port, required=True)
    metrics.add_argument("--metrics-addr", default="127.0.0.1", help="numeric address to bind")
    return parser


def _metrics(args: argparse.Namespace) -> int:
    from .ops.exporter import serve_server_metrics

    host, port = args.addr
    serve_server_metrics(host, port, args.metrics_port, args.metrics_addr, args.timeout)
    print(f"elasticstore metrics of {host}:{port} on http://{args.metrics_addr}:"
          f"{args.metrics_port}/metrics", flush=True)
    stop = threading.Event()
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, lambda *_: stop.set())
    stop.wait()
    return 0


def _job(args: argparse.Namespace) -> int:
    from .ops import JobAddress, forget_run, job_status, render, stop_job

    if not args.rdzv_id:
        print(f"elasticstore: {args.command}: --rdzv-id is required", file=sys.stderr)
        return 1
    host, port = args.addr
    endpoint = args.rdzv_endpoint or (f"[{host}]:{port}" if ":" in host else f"{host}:{port}")
    addr = JobAddress(endpoint, args.rdzv_id, registry.backend(args.rdzv_backend).label,
                      args.timeout, args.etcd_prefix, args.cacert, args.cert, args.key, args.user,
                      args.password, _token(args))
    if args.command == "stop":
        rnd = stop_job(addr)
        print(f"job {args.rdzv_id}: stopped by operator"
              + (f" (round {rnd.round}, {rnd.world_size} node(s))" if rnd else ""), flush=True)
        return 0
    if args.command == "forget":
        count = forget_run(addr, args.force)
        print(f"job {args.rdzv_id}: forgot {count} key(s); the run id can be used again",
              flush=True)
        return 0
    if args.json:
        print(json.dumps(job_status(addr), sort_keys=True), flush=True)
        return 0
    if not args.watch:
        print(render(job_status(addr)), flush=True)
        return 0
    from .ops.watch import watch

    return watch(lambda: job_status(addr), args.interval)


def _serve(args: argparse.Namespace) -> int:
    from .stores.native.server import ServerConfig, StoreServer

    config = ServerConfig(
        host=args.host,
        port=args.port,
        backlog=args.backlog,
        max_connections=args.max_connections,
        log_level=args.log_level,
        token=_token(args),
        allow_unauthenticated_from=tuple(args.allow_unauthenticated_from),
        limits=limits_from_args(args),
        torch_protocol=args.torch_protocol == "on",
    )
    # Python runs signal handlers in the main thread whichever thread the kernel picked (the
    # server's, or one torch started at import); the handler only wakes the main thread.
    stop = threading.Event()

    def on_signal(signum: int, frame: object) -> None:
        stop.set()

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, on_signal)
    with StoreServer.from_config(config) as server:
        if args.metrics_port is not None:
            from .ops.exporter import serve_stats_metrics

            serve_stats_metrics(server.stats, args.metrics_port, args.metrics_addr)
        print(f"elasticstore server listening on {server.address}", flush=True)
        if args.metrics_port is not None:
            print(f"elasticstore server metrics on http://{args.metrics_addr}:"
                  f"{args.metrics_port}/metrics", flush=True)
        stop.wait()  # interruptible: the handler runs during the wait and sets the event
    return 0


def _client(args: argparse.Namespace) -> int:
    from datetime import timedelta

    from .ops.terminal import printable
    from .stores.native.store import Store

    host, port = args.addr
    wait = timedelta(seconds=args.timeout)
    with Store(host, port, timeout=wait, connect_timeout=wait, token=_token(args)) as store:
        if args.command == "get":
            value = store.try_get(args.key)
            if value is None:
                print(f"elasticstore: {printable(args.key)}: no such key", file=sys.stderr)
                return 1
            sys.stdout.buffer.write(value + b"\n")
        elif args.command == "set":
            store.set(args.key, args.value)
        elif args.command == "ls":
            for key in store.list_keys(args.prefix):
                print(printable(key))
        else:
            for name, count in sorted(store.stats().items()):
                print(f"{name} {count}")
    sys.stdout.flush()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "server":
            return _serve(args)
        if args.command == "metrics":
            return _metrics(args)
        if args.command in ("stop", "forget") or (args.command == "status" and (args.rdzv_id or args.json or args.watch)):
            return _job(args)
        return _client(args)
    except OSError as exc:  # bind/listen failures: OSError(errno, message) without "[Errno N]"
        print(f"elasticstore: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except (RuntimeError, ValueError, RendezvousError) as exc:  # store and network errors too
        print(f"elasticstore: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
