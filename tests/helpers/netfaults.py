"""Network faults for the tests: a simulated node is a network namespace joined to the root
namespace by a veth pair; its link can be partitioned, made lossy, or taken down, and healed.

Addresses: node ``i`` (0..15) gets the 16-address block ``198.51.100.16*i/28`` of TEST-NET-2
(RFC 5737: documentation only, never routed, and not used by this machine, whose own network is
192.0.2.0/24). The root end of the veth is ``.16*i+1`` (the servers of the test bind it), extra
root-side addresses ``.16*i+2 ..`` are ``/32`` aliases on the same veth (more "hosts" in the root
namespace, each reachable from the node), and the node's own address is ``.16*i+14``. These
addresses exist only on our veths: nothing leaves the machine, nothing but the node talks over
them, and deleting the namespace (which takes its veth end, hence the pair) removes them all.

Faults, all applied inside the node's namespace (the root namespace's firewall and qdiscs are
never touched):

- partition: ``iptables -j DROP`` on the node's veth, both directions (silent: no RST, no FIN);
- loss: ``iptables -m statistic --mode random --probability P -j DROP``, both directions;
- link down: ``ip link set DEV down`` on the node's end (the root end loses its carrier);
- latency and jitter: ``tc netem`` when the kernel has it; this CI kernel has no ``sch_netem``
  (and no fq qdisc for eBPF departure times), so :class:`DelayRelay` adds latency and jitter in
  user space instead: a TCP relay in the test process that holds each chunk for delay +/- jitter,
  in order, per direction. Point the node's client at the relay; the kernel's loss applies below.

``available()`` says why the tests cannot run (not root, no ``ip``/``iptables``, no namespaces);
``leftovers()`` lists the namespaces and links of this process still present (tests check it is
empty at the end).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import TracebackType

SUBNET = "198.51.100"  # TEST-NET-2 (RFC 5737)
_PREFIX = f"esfaults-{os.getpid()}-"
_LINK = f"esf{os.getpid() % 100000}n"  # veth names: at most 15 bytes
_CMD_TIMEOUT = 20.0


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Runs one command (bounded); raises with its stderr when ``check`` and it fails."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
    return done


def available() -> str | None:
    """None when namespaces, veths and iptables can be used here; otherwise the reason."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (apt-get install iproute2 iptables)"
    probe = f"{_PREFIX}probe"
    try:
        run("ip", "netns", "add", probe)
        run("ip", "netns", "exec", probe, "iptables", "-S")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces or iptables unusable: {exc}"
    finally:
        run("ip", "netns", "del", probe, check=False)
    return None


def netem_available() -> bool:
    """Whether ``tc netem`` works (a veth in a scratch namespace)."""
    probe = f"{_PREFIX}netem"
    try:
        run("ip", "netns", "add", probe)
        run("ip", "-n", probe, "link", "add", "a", "type", "veth", "peer", "name", "b")
        return run("tc", "-n", probe, "qdisc", "add", "dev", "a", "root", "netem", "delay",
                   "1ms", check=False).returncode == 0
    except (RuntimeError, OSError, subprocess.TimeoutExpired):
        return False
    finally:
        run("ip", "netns", "del", probe, check=False)


def leftovers() -> list[str]:
    """This process's namespaces and veth ends still present."""
    names = run("ip", "netns", "list", check=False).stdout.split()
    links = run("ip", "-o", "link", "show", check=False).stdout.splitlines()
    return [n for n in names if n.startswith(_PREFIX)] + [
        line.split(":")[1].strip().split("@")[0] for line in links
        if line.split(":")[1].strip().startswith(_LINK)
    ]


class Node:
    """A namespace ``esfaults-PID-I`` with a veth pair to the root namespace (see the module's
    docstring for the addresses). Use :func:`node` to get one that is removed afterwards."""

    def __init__(self, index: int, root_aliases: int = 0) -> None:
        if not 0 <= index < 16 or not 0 <= root_aliases <= 10:
            raise ValueError("index 0..15, root_aliases 0..10")
        base = 16 * index
        self.ns = f"{_PREFIX}{index}"
        self.dev_root = f"{_LINK}{index}r"
        self.dev_node = f"{_LINK}{index}x"
        self.root_addr = f"{SUBNET}.{base + 1}"
        self.root_aliases = [f"{SUBNET}.{base + 2 + k}" for k in range(root_aliases)]
        self.addr = f"{SUBNET}.{base + 14}"
        self._rules: list[list[str]] = []
        run("ip", "netns", "add", self.ns)
        try:
            run("ip", "link", "add", self.dev_root, "type", "veth", "peer", "name", self.dev_node,
                "netns", self.ns)
            run("ip", "addr", "add", f"{self.root_addr}/28", "dev", self.dev_root)
            for alias in self.root_aliases:
                run("ip", "addr", "add", f"{alias}/32", "dev", self.dev_root)
            run("ip", "link", "set", self.dev_root, "up")
            self.ip("addr", "add", f"{self.addr}/28", "dev", self.dev_node)
            self.ip("link", "set", "lo", "up")
            self.ip("link", "set", self.dev_node, "up")
            self._wait_reachable()
        except BaseException:
            self.close()
            raise

    def _wait_reachable(self, timeout: float = 30.0) -> None:
        """Until a TCP connect from the node to a root-side port is answered (refused is fine).
        One process in the namespace tries again and again (each try up to 2 s: a SYN sent before
        the new link carries is retransmitted after 1 s), so a loaded machine does not spend the
        time on interpreter start-ups."""
        with socket.socket() as listener:
            listener.bind((self.root_addr, 0))
            listener.listen(8)
            port = listener.getsockname()[1]
            code = ("import socket, sys, time\n"
                    f"end = time.monotonic() + {timeout}\n"
                    "while time.monotonic() < end:\n"
                    "    try:\n"
                    f"        socket.create_connection(('{self.root_addr}', {port}), timeout=2).close()\n"
                    "        sys.exit(0)\n"
                    "    except OSError:\n"
                    "        time.sleep(0.1)\n"
                    "sys.exit(1)\n")
            try:
                done = subprocess.run([*self.prefix(), sys.executable, "-c", code],
                                      capture_output=True, timeout=timeout + 30, check=False)
            except subprocess.TimeoutExpired:
                done = None
            if done is not None and done.returncode == 0:
                return
        raise RuntimeError(f"{self.ns}: {self.root_addr} not reachable within {timeout}s")

    def prefix(self) -> list[str]:
        """The command prefix that runs a program inside the namespace (same pid: ``ip netns
        exec`` execs it)."""
        return ["ip", "netns", "exec", self.ns]

    def ip(self, *args: str) -> None:
        run("ip", "-n", self.ns, *args)

    def _iptables(self, *rule: str) -> None:
        run(*self.prefix(), "iptables", "-A", *rule)
        self._rules.append(list(rule))

    def partition(self) -> float:
        """Drops every packet on the node's link, both ways (silently). Returns the wall time."""
        self._iptables("INPUT", "-i", self.dev_node, "-j", "DROP")
        self._iptables("OUTPUT", "-o", self.dev_node, "-j", "DROP")
        return time.time()

    def loss(self, fraction: float) -> None:
        """Drops each packet with this probability, in each direction."""
        p = f"{fraction:.4f}"
        self._iptables("INPUT", "-i", self.dev_node, "-m", "statistic", "--mode", "random",
                       "--probability", p, "-j", "DROP")
        self._iptables("OUTPUT", "-o", self.dev_node, "-m", "statistic", "--mode", "random",
                       "--probability", p, "-j", "DROP")

    def drop_first_syn(self) -> None:
        """Drops the next connection request (TCP SYN) the node sends, once: what a lossy link
        does to one connect. The kernel sends it again only after its 1 s retransmission
        timeout."""
        self._iptables("OUTPUT", "-o", self.dev_node, "-p", "tcp", "--syn", "-m", "statistic",
                       "--mode", "nth", "--every", "1000000", "--packet", "0", "-j", "DROP")

    def heal(self) -> float:
        """Removes every rule added (partition and loss) and brings the link up. Returns the
        wall time."""
        for rule in reversed(self._rules):
            run(*self.prefix(), "iptables", "-D", *rule)
        self._rules.clear()
        self.ip("link", "set", self.dev_node, "up")
        return time.time()

    def link_down(self) -> float:
        self.ip("link", "set", self.dev_node, "down")
        return time.time()

    def rules(self) -> str:
        return run(*self.prefix(), "iptables", "-S").stdout

    def close(self) -> None:
        """Deletes the namespace (with its rules and its veth end, hence the pair). Processes
        still running inside keep it alive: kill them first."""
        run("ip", "link", "del", self.dev_root, check=False)
        run("ip", "netns", "del", self.ns, check=False)

    def __enter__(self) -> Node:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


@contextmanager
def node(index: int = 0, root_aliases: int = 0) -> Iterator[Node]:
    with Node(index, root_aliases) as made:
        yield made


class DelayRelay:
    """A TCP relay on ``listen_host`` (port 0: picked) to ``target``, adding ``delay`` +/- a
    uniform ``jitter`` (seconds) to every chunk, in order, in each direction. Threads are daemons;
    ``close()`` closes every socket and joins them (bounded)."""

    def __init__(self, listen_host: str, target: tuple[str, int], delay: float, jitter: float,
                 seed: int = 11) -> None:
        self.target, self.delay, self.jitter = target, delay, jitter
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._socks: list[socket.socket] = []
        self._threads: list[threading.Thread] = []
        self._closed = False
        self._listener = socket.socket()
        self._listener.bind((listen_host, 0))
        self._listener.listen(64)
        self.address = f"{listen_host}:{self._listener.getsockname()[1]}"
        self.port = int(self._listener.getsockname()[1])
        self._spawn(self._accept)

    def _spawn(self, fn: Callable[..., None], *args: object) -> None:
        thread = threading.Thread(target=fn, args=args, daemon=True)
        with self._lock:
            self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target, timeout=10)
                upstream.settimeout(None)
            except OSError:
                conn.close()
                continue
            for s in (conn, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                self._socks += [conn, upstream]
            self._spawn(self._pump, conn, upstream)
            self._spawn(self._pump, upstream, conn)

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        due: deque[tuple[float, bytes]] = deque()
        cond = threading.Condition()
        done = [False]

        def send() -> None:
            while True:
                with cond:
                    while not due and not done[0]:
                        cond.wait(1.0)
                    if not due:
                        break
                    at, chunk = due[0]
                wait = at - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                with cond:
                    due.popleft()
                try:
                    dst.sendall(chunk)
                except OSError:
                    break
            try:
                dst.shutdown(socket.SHUT_WR)
            except OSError:
                pass

        self._spawn(send)
        last = 0.0
        while True:
            try:
                chunk = src.recv(65536)
            except OSError:
                chunk = b""
            with cond:
                if not chunk:
                    done[0] = True
                    cond.notify()
                    return
                with self._lock:
                    hold = self.delay + self._rng.uniform(-self.jitter, self.jitter)
                last = max(last, time.monotonic() + hold)  # in order, as TCP delivers
                due.append((last, chunk))
                cond.notify()

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            socks, threads = list(self._socks), list(self._threads)
        for s in socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        for thread in threads:
            thread.join(timeout=5)

    def __enter__(self) -> DelayRelay:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
