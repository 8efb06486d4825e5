"""The client and the adapter under conditions a demanding user meets: a server that stops
answering, fork(), stores dropped without close(), re-initialising one elasticstore:// URL, host
names, and the syscalls of the hot path. Real servers on loopback, real processes."""

from __future__ import annotations

import gc
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import spawned
import pytest
import torch.distributed as dist

from elasticstore import Store, StoreNetworkError, StoreServer
from elasticstore.stores import keepalive

SLACK = 1.5  # seconds allowed past a timeout (loaded 2-core machine)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def server_process() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """An ``elasticstore server`` subprocess (so that it can be stopped with SIGSTOP)."""
    with spawned.cli_server() as server:
        yield server.proc, server.port


def _stop(pid: int) -> None:
    """SIGSTOP, and wait until every thread of ``pid`` is stopped (delivery is asynchronous: a
    server thread running on the other CPU may still answer a request sent right after kill)."""
    os.kill(pid, signal.SIGSTOP)

    def stopped() -> bool:
        try:
            tasks = os.listdir(f"/proc/{pid}/task")
            states = []
            for tid in tasks:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
        except OSError:
            return False
        return all(state in ("T", "t") for state in states)

    spawned.wait_until(stopped, 10, f"process {pid} to stop")
    time.sleep(0.1)


def _bounded(call: Callable[[], Any], limit: float) -> tuple[float, BaseException | None]:
    """Runs ``call`` on a thread; fails unless it returns or raises within ``limit`` seconds.
    Returns (seconds taken, exception raised or None)."""
    result: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 (reported to the test)
            result["exc"] = exc
        result["dt"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    started = time.monotonic()
    thread.start()
    thread.join(limit)
    if thread.is_alive():
        pytest.fail(f"the call was still blocked after {time.monotonic() - started:.1f} s")
    return result["dt"], result.get("exc")


# -- item 6: every call is bounded by the store's timeout ----------------------------------------


def test_calls_on_a_stopped_server_fail_within_the_timeout(
    server_process: tuple[subprocess.Popen[str], int],
) -> None:
    proc, port = server_process
    timeout = 1.0
    store = Store("127.0.0.1", port, timeout=timedelta(seconds=timeout))
    try:
        store.set("warm", "1")
        _stop(proc.pid)
        # The first call finds the connection open (no reply); the next ones reconnect (the kernel
        # accepts, the stopped server never answers HELLO). Each is bounded by the timeout.
        calls: list[tuple[str, Callable[[], Any], list[str]]] = [
            ("set", lambda: store.set("the-key", "v"), ['"the-key"']),
            ("add", lambda: store.add("counter", 1), ['"counter"']),
            ("check", lambda: store.check(["k1", "k2"]), ['"k1"', '"k2"']),
            ("compare_set", lambda: store.compare_set("cas", "a", "b"), ['"cas"']),
            ("get", lambda: store.get("g"), ['"g"']),
        ]
        for name, call, keys in calls:
            # get blocks server-side: its reply may take the timeout plus the 2 s slack.
            limit = timeout + (2.0 if name == "get" else 0.0) + SLACK
            dt, exc = _bounded(call, limit + 10.0)
            assert dt <= limit, f"{name} took {dt:.2f} s"
            assert isinstance(exc, StoreNetworkError), (name, exc)
            assert isinstance(exc, dist.DistNetworkError)
            message = str(exc)
            assert message.startswith(name + " "), message
            for key in keys:
                assert key in message, message
        os.kill(proc.pid, signal.SIGCONT)
        store.set("after", "1")  # usable again once the server answers
        assert store.get("after") == b"1"
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        store.close()


def test_set_connect_timeout_bounds_the_next_reconnect() -> None:
    """A lost server (nothing listens any more) is retried for the connect timeout the store has
    when the call starts: the one given, then the one set (clones take the new one too)."""
    server = StoreServer("127.0.0.1", 0)
    store = Store("127.0.0.1", server.port, timeout=timedelta(seconds=30),
                  connect_timeout=timedelta(seconds=0.3))
    try:
        store.set("warm", "1")
        server.close()
        with pytest.raises(StoreNetworkError):  # the connection it finds closed
            store.set("k", "v")
        for budget, low in ((0.3, 0.0), (2.0, 1.9)):
            if budget != 0.3:
                store.set_connect_timeout(timedelta(seconds=budget))
            assert store.connect_timeout == timedelta(seconds=budget)
            dt, exc = _bounded(lambda: store.set("k", "v"), 30.0)
            assert isinstance(exc, StoreNetworkError), exc
            assert low <= dt <= budget + SLACK, f"budget {budget}: {dt:.2f} s"
            assert "reconnect" in str(exc), str(exc)
    finally:
        store.close()
        server.close()


def test_set_timeout_applies_to_calls_that_do_not_block(
    server_process: tuple[subprocess.Popen[str], int],
) -> None:
    proc, port = server_process
    store = Store("127.0.0.1", port, timeout=timedelta(seconds=60))
    try:
        store.set("warm", "1")
        store.set_timeout(timedelta(seconds=0.5))
        _stop(proc.pid)
        dt, exc = _bounded(lambda: store.add("n", 1), 0.5 + SLACK + 10.0)
        assert dt <= 0.5 + SLACK, dt
        assert isinstance(exc, StoreNetworkError)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        store.close()


# A client whose process was stopped past its deadline (SIGSTOP, a debugger, a frozen cgroup) takes
# the reply that came meanwhile, and one from a server stopped with it (hosted in its process, as
# an agent hosts the rendezvous store) once both run again: a late wake-up is not a lost server.
_STOPPED_CLIENT = textwrap.dedent("""
    import sys
    from datetime import timedelta
    from elasticstore import Store, StoreServer, StoreNetworkError, StoreTimeoutError
    host, port = sys.argv[1], int(sys.argv[2])
    if port == 0:  # a server hosted in this process, stopped with it
        import threading, time
        server = StoreServer("127.0.0.1", 0)
        host, port = server.host, server.port

        def blocked():  # says when the server holds the wait below (its timer runs)
            while server.stats()["waiters"] < 1:
                time.sleep(0.01)
            print("blocked", flush=True)

        threading.Thread(target=blocked, daemon=True).start()
    store = Store(host, port, timeout=timedelta(seconds=1))
    print("waiting", flush=True)
    try:
        store.wait(["never"], timedelta(seconds=1))
        print("returned", flush=True)
    except StoreTimeoutError as exc:
        print("timeout:", exc, flush=True)
    except StoreNetworkError as exc:
        print("network:", exc, flush=True)
    store.set("after", "1")
    print("after:", store.get("after").decode(), flush=True)
""")


@pytest.mark.parametrize("where", ["remote", "in-process"])
def test_a_client_stopped_past_its_deadline_takes_the_reply_that_came(
        server: StoreServer, where: str) -> None:
    port = server.port if where == "remote" else 0
    proc = subprocess.Popen([sys.executable, "-c", _STOPPED_CLIENT, server.host, str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        if not select.select([proc.stdout], [], [], 60)[0]:
            pytest.fail("the client did not start")
        assert proc.stdout.readline().strip() == "waiting"
        # The server holds the wait (its timeout 1 s; the client's deadline 3 s) before the stop.
        if where == "remote":
            spawned.wait_until(lambda: server.stats()["waiters"] >= 1, 10, "the client's wait")
        elif not select.select([proc.stdout], [], [], 10)[0] or \
                proc.stdout.readline().strip() != "blocked":
            pytest.fail("the client's server never held its wait")
        _stop(proc.pid)
        time.sleep(4.0)  # past both: the server's timeout reply, if remote, is waiting for it
        os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()
    lines = out.strip().splitlines()
    assert lines[0].startswith("timeout: wait reached its timeout after"), out
    assert lines[1] == "after: 1", out  # the connection was kept


# -- item 7: fork() ------------------------------------------------------------------------------


def test_forked_child_and_parent_never_share_a_connection(server: StoreServer) -> None:
    """The child blocks in ``get`` while the parent makes calls: on one shared socket (and one
    request-id counter) either may read the other's reply."""
    store = Store(server.host, server.port, timeout=timedelta(seconds=2))
    other = Store(server.host, server.port, timeout=timedelta(seconds=2))
    rounds = 15
    try:
        store.set("parent-value", "parent")
        store.set("parent-ephemeral", "1", ephemeral=True)
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # child: the count of wrong values is its exit status
            wrong = 0
            try:
                for i in range(rounds):
                    os.write(ready_w, b"r")
                    try:
                        if store.get(f"child/{i}") != f"for-child-{i}".encode():
                            wrong += 1
                    except dist.DistError:  # a reply out of step, or none (timeout)
                        wrong += 1
                store.close()  # must not disturb the parent's calls
            except BaseException:  # noqa: BLE001
                wrong = 100
            os._exit(min(wrong, 255))
        wrong = 0
        for i in range(rounds):
            if not select.select([ready_r], [], [], 10.0)[0]:
                pytest.fail("the child stopped making calls")
            os.read(ready_r, 1)
            time.sleep(0.05)  # the child is (about to be) blocked in its get
            try:
                if store.get("parent-value") != b"parent":
                    wrong += 1
            except dist.DistError:  # a reply out of step (protocol error), or none
                wrong += 1
            other.set(f"child/{i}", f"for-child-{i}")
        _, status = os.waitpid(pid, 0)
        child_wrong = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1
        assert (wrong, child_wrong) == (0, 0), (
            f"wrong values: {wrong} of {rounds} in the parent, {child_wrong} of {rounds} in the "
            "child"
        )
        # The child used its own connection: the parent's session and its key survive.
        assert store.get("parent-ephemeral") == b"1"
        os.close(ready_r)
        os.close(ready_w)
    finally:
        store.close()
        other.close()


# -- item 8: parking only what torch's C++ side holds ---------------------------------------------


def _parked_for(port: int) -> int:
    return sum(1 for s in list(keepalive.PARKED) if getattr(s, "port", None) == port)


def test_dropped_clones_are_freed_not_parked(server: StoreServer) -> None:
    store = Store(server.host, server.port)
    try:
        before = len(keepalive.PARKED)
        for _ in range(500):
            store.clone()  # dropped at once, never closed
        gc.collect()
        assert len(keepalive.PARKED) == before
        spawned.wait_until(lambda: server.stats()["connections"] == 1, 10, "the clones to close")
    finally:
        store.close()


def test_parked_store_is_released_when_torch_lets_it_go(server: StoreServer) -> None:
    prefix = dist.PrefixStore("p", Store(server.host, server.port))
    gc.collect()
    assert _parked_for(server.port) == 1  # only torch's C++ PrefixStore holds it
    prefix.set("a", "1")  # C++ calls still reach it (it reconnects)
    assert prefix.get("a") == b"1"
    del prefix  # torch lets it go
    gc.collect()
    assert _parked_for(server.port) == 0
    spawned.wait_until(lambda: server.stats()["connections"] == 0, 10, "the connection to close")


# -- item 9: elasticstore:// twice on one URL ------------------------------------------------------

_TWICE = textwrap.dedent(
    """
    import sys, time
    from datetime import timedelta
    import torch, torch.distributed as dist
    import elasticstore
    url, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    for round in range(2):
        dist.init_process_group("gloo", init_method=url, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        t = torch.tensor([rank + 1.0])
        dist.all_reduce(t)
        assert t.item() == world * (world + 1) / 2, t
        dist.barrier()
        dist.destroy_process_group()
        if rank != 0:
            # As with tcp://: a rank that re-initialises before rank 0 released its group may
            # still reach rank 0's old server.
            time.sleep(1.0)
    print("ok", flush=True)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_init_method_twice_on_one_url(host: str) -> None:
    url = f"elasticstore://{host}:{_free_port()}"
    children = [
        subprocess.Popen(
            [sys.executable, "-c", _TWICE, url, str(rank), "2"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(2)
    ]
    try:
        for child in children:
            out, err = child.communicate(timeout=120)
            assert child.returncode == 0 and out.strip() == "ok", err[-3000:]
    finally:
        spawned.kill_all(children)


# -- item 10: host names -------------------------------------------------------------------------


def _own_name_on_loopback() -> str | None:
    name = socket.gethostname()
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    return name if infos and infos[0][4][0] == "127.0.0.1" else None


def test_host_names_are_resolved() -> None:
    names = ["localhost"] + [n for n in [_own_name_on_loopback()] if n]
    for name in names:
        with StoreServer(name, 0) as server:
            assert server.host in ("127.0.0.1", "::1")  # the numeric address bound
            with Store(name, server.port, timeout=timedelta(seconds=10)) as store:
                store.set("k", name)
                assert store.get("k") == name.encode()
                assert store.host == name


def test_unresolvable_name_fails_within_the_timeout() -> None:
    # This machine's resolver never answers for it: without a bound, the lookup hangs.
    dt, exc = _bounded(
        lambda: Store("no-such-host.invalid", 29400, timeout=timedelta(seconds=1)), 1.0 + 15.0
    )
    assert dt <= 1.0 + SLACK, dt
    assert isinstance(exc, StoreNetworkError), exc
    assert 'cannot resolve "no-such-host.invalid"' in str(exc)
    dt, exc = _bounded(lambda: StoreServer("no-such-host.invalid", 0, resolve_timeout=1.0), 1.0 + 15.0)
    assert dt <= 1.0 + SLACK, dt
    assert isinstance(exc, OSError), exc
    assert "no-such-host.invalid" in str(exc)


@pytest.mark.slow
def test_init_method_with_this_machines_name() -> None:
    name = _own_name_on_loopback()
    if name is None:
        pytest.skip("this machine's name does not resolve to 127.0.0.1")
    script = textwrap.dedent(
        """
        import sys
        import torch.distributed as dist
        import elasticstore
        dist.init_process_group("gloo", init_method=sys.argv[1], rank=0, world_size=1)
        dist.barrier()
        dist.destroy_process_group()
        print("ok")
        """
    )
    url = f"elasticstore://{name}:{_free_port()}"
    out = subprocess.run(
        [sys.executable, "-c", script, url], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


# -- item 16: two syscalls per call on a recently used connection -----------------------------------

_EXIT_DURING_A_CALL = textwrap.dedent(
    """
    import sys, threading, time
    from datetime import timedelta
    from elasticstore import Store
    host, port, early = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    store = Store(host, port, timeout=timedelta(seconds=1))
    threading.Thread(target=lambda: store.get("never"), daemon=True).start()
    time.sleep(1.0 - early)  # the thread's get() times out while the interpreter finalizes
    print("exiting", flush=True)
    """
)


@pytest.mark.parametrize("early", [0.05, 0.2])
def test_a_daemon_thread_whose_call_ends_at_exit_does_not_abort(server: StoreServer,
                                                                 early: float) -> None:
    """A daemon thread taking the GIL back while the interpreter finalizes is ended by
    pthread_exit; unwinding through the GIL guard used to abort the process (exit -6, "terminate
    called without an active exception"). Now the thread is parked and the process exits 0."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_DURING_A_CALL, server.host,
                           str(server.port), str(early)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == "exiting\n", proc.stderr
    assert "terminate called" not in proc.stderr


_LOOP = textwrap.dedent(
    """
    import os, sys
    import elasticstore
    store = elasticstore.Store("127.0.0.1", int(sys.argv[1]))
    for _ in range(50):
        store.add("n", 1)
    os.write(2, b"MEASURE\\n")
    for _ in range(500):
        store.add("n", 1)
        store.check(["n"])
        store.compare_set("n", "x", "y")
    os.write(2, b"DONE\\n")
    """
)


def test_hot_path_is_send_and_recv(server: StoreServer) -> None:
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("strace is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "trace")
        subprocess.run(
            [strace, "-f", "-o", out, "-e", "trace=network,poll,ppoll,select,write",
             sys.executable, "-c", _LOOP, str(server.port)],
            check=True, capture_output=True, timeout=120,
        )
        with open(out) as f:
            lines = f.read().splitlines()
    start = next(i for i, line in enumerate(lines) if "MEASURE" in line)
    end = next(i for i, line in enumerate(lines) if "DONE" in line)
    names = [line.split(None, 1)[1].split("(")[0] for line in lines[start + 1 : end]]
    names = [n for n in names if not n.startswith(("<", "+++", "---"))]
    per_call = len(names) / 1500
    assert per_call <= 2.01, f"{per_call:.2f} syscalls per call: {sorted(set(names))}"
