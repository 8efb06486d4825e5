"""``elasticstore forget``: a stopped run's keys stay on an external store (so its run id is
refused: "closed") until forget removes them; refused while an agent of the run lives unless
--force. On the native store and on etcd, with real rendezvous handlers as the agents."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

import elasticstore

pytestmark = pytest.mark.slow


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "elasticstore.cli", *args], capture_output=True,
                          text=True, timeout=60)


class Target:
    """A rendezvous store: how the CLI and a handler address it, and its raw keys."""

    def __init__(self, backend: str, endpoint: str, run_id: str, prefix: str | None) -> None:
        self.backend, self.endpoint, self.run_id, self.prefix = backend, endpoint, run_id, prefix
        self.flags = ["--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--timeout", "10"]
        if prefix is not None:
            self.flags += ["--rdzv-backend", "etcd", "--etcd-prefix", prefix]

    def handler(self) -> Any:
        conf: dict[str, Any] = {"last_call_timeout": 0.2, "join_timeout": 30}
        if self.prefix is not None:
            conf.update(etcd_prefix=self.prefix, lease_ttl=2)
        return get_rendezvous_handler(RendezvousParameters(
            self.backend, self.endpoint, self.run_id, 1, 1, "127.0.0.3", **conf))

    def keys(self) -> list[str]:
        if self.prefix is None:
            host, port = self.endpoint.rsplit(":", 1)
            with elasticstore.Store(host, int(port)) as st:
                return [*st.list_keys(f"rdzv/{self.run_id}/"), *st.list_keys(f"status/{self.run_id}/")]
        with elasticstore.EtcdStore(self.endpoint, prefix=self.prefix) as st:
            return [*st.list_keys(f"rdzv/{self.run_id}/"), *st.list_keys(f"status/{self.run_id}/")]


@contextmanager
def native() -> Iterator[Target]:
    with elasticstore.StoreServer("127.0.0.2", 0) as server:
        yield Target("elasticstore", server.address, "job", None)


@contextmanager
def etcd() -> Iterator[Target]:
    etcd_cluster = pytest.importorskip("etcd_cluster")
    pytest.importorskip("etcd3")
    cluster = etcd_cluster.shared()
    yield Target("elasticstore-etcd", cluster.endpoints[0], "job",
                 f"/forget-{uuid.uuid4().hex[:8]}")


@pytest.mark.parametrize("store", [native, etcd], ids=["native", "etcd"])
def test_forget_a_stopped_run_to_reuse_its_id(store: Any) -> None:
    with store() as t:
        agent = t.handler()
        try:
            assert agent.next_rendezvous().world_size == 1
            agent.publish_status({"state": "running"})
            refused = cli("forget", *t.flags)
            assert refused.returncode == 1, refused.stdout
            assert refused.stderr.strip() == (
                f"elasticstore: job 'job' at {t.endpoint} still has 1 live agent(s) "
                f"({agent.node_id}): stop it first (elasticstore stop), or pass --force")
            assert cli("stop", *t.flags).returncode == 0
        finally:
            agent.shutdown()
        assert any(k.endswith("/ctl/closed") for k in t.keys())

        late = t.handler()
        try:
            with pytest.raises(RendezvousClosedError) as closed:
                late.next_rendezvous()
        finally:
            late.shutdown()
        hint = f"elasticstore forget{' --rdzv-backend etcd --etcd-prefix ' + t.prefix if t.prefix else ''}"
        assert f"(stopped by operator); to reuse the run id, remove its keys: {hint} " \
               f"--rdzv-endpoint {t.endpoint} --rdzv-id job" in str(closed.value)

        out = cli("forget", *t.flags)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("job job: forgot ") and "can be used again" in out.stdout
        assert t.keys() == []
        gone = cli("forget", *t.flags)
        assert gone.returncode == 1 and gone.stderr.strip() == f"elasticstore: no job 'job' at {t.endpoint}"

        again = t.handler()  # the run id works again, from round 1
        try:
            assert again.next_rendezvous().world_size == 1 and again.round.round == 1
            forced = cli("forget", *t.flags, "--force")
            assert forced.returncode == 0, forced.stderr
            assert t.keys() == [] or all("/alive/" in k for k in t.keys())  # its heartbeat
        finally:
            again.shutdown()
