"""Warm restarts preload what the previous round's workers imported: third-party packages only
(found in a directory named site-packages on the workers' path: here a PYTHONPATH entry laid out
as ``pip install --target`` writes one), never the script's own modules or project code; a
package whose import starts a thread is refused and named; ``--no-preload-imports`` turns it off.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import pathlib
import shutil
import sys
import time
from importlib.machinery import PathFinder
from typing import Any

import pytest
from agent_nodes import agents, free_port
from paths import ROOT, program

import torch

from elasticstore.agent.forkclient import ForkServer, read_status
from elasticstore.agent.job_imports import held_names, teach
from elasticstore.agent.importreport import third_party_origin
from elasticstore.run import parse

JOB = program("preload_job.py")


def _a_shared_library() -> str:
    """A shared library file of this interpreter (an extension module; some builds link them in)."""
    import importlib

    for name in ("_bisect", "_json", "_struct", "_ctypes", "_random", "_socket", "math"):
        path = getattr(importlib.import_module(name), "__file__", None)
        if path and path.endswith(".so"):
            return str(path)
    return str(torch._C.__file__)


def _driver_mapped() -> bool:
    """A GPU host's ``import torch`` maps the CUDA driver library already (not initialising CUDA)."""
    with open("/proc/self/maps") as f:
        return "libcuda.so" in f.read()
SLOW_IMPORT_S = 1.0
# slowpkg.lazy: a submodule imported on use (as transformers imports its own); slowpkg.optional:
# one whose import fails (an optional dependency that is not installed).
MODULES = "threadpkg,cudapkg,slowpkg,?slowpkg.optional,slowpkg.lazy,projmod,preload_localmod"


def _layout(workdir: str, extra: dict[str, str] | None = None) -> tuple[str, dict[str, str]]:
    """A site directory with third-party packages, a project directory and the script with a
    module beside it; returns the script's path and the agent's environment."""
    site = os.path.join(workdir, "env", "lib", "site-packages")
    proj = os.path.join(workdir, "proj")
    app = os.path.join(workdir, "app")
    for d in (os.path.join(site, "slowpkg"), proj, app):
        os.makedirs(d)
    driver = os.path.join(workdir, "driver", "libcuda.so.1")
    os.makedirs(os.path.dirname(driver))
    shutil.copy(_a_shared_library(), driver)
    # Each package says who imported it: the worker, the fork server's probe or the fork server.
    said = (f"import os\nwith open({os.path.join(workdir, 'imports.log')!r}, 'a') as f:\n"
            "    f.write(f'{__name__} {os.getpid()} {os.getppid()}\\n')\n")
    files = {
        os.path.join(site, "slowpkg", "__init__.py"):
            f"import os, time\nRANK = os.environ.get('LOCAL_RANK')\ntime.sleep({SLOW_IMPORT_S})\n",
        os.path.join(site, "slowpkg", "lazy.py"): f"{said}import time\ntime.sleep({SLOW_IMPORT_S})\n",
        os.path.join(site, "slowpkg", "optional.py"): "import not_installed_anywhere\n",
        os.path.join(site, "threadpkg.py"):
            "import threading, time\n"
            "threading.Thread(target=time.sleep, args=(3600,), daemon=True, name='poller').start()\n",
        # Loads a library named as the CUDA driver is (any shared library will do on a CPU host).
        os.path.join(site, "cudapkg.py"): f"import ctypes\nctypes.CDLL({driver!r})\n",
        os.path.join(proj, "projmod.py"): "VALUE = 1\n",
        os.path.join(app, "preload_localmod.py"): "VALUE = 2\n",
    }
    for name, text in (extra or {}).items():
        files[os.path.join(site, name)] = said + text
    for path, text in files.items():
        with open(path, "w") as f:
            f.write(text)
    script = os.path.join(app, "preload_job.py")
    shutil.copy(JOB, script)
    pythonpath = os.pathsep.join([site, proj, os.environ.get("PYTHONPATH", "")])
    return script, {"PYTHONPATH": pythonpath}


def _records(workdir: str) -> dict[int, dict[str, Any]]:
    """attempt -> what rank 0 recorded."""
    found = {}
    for path in glob.glob(os.path.join(workdir, "preload-*-0.json")):
        with open(path) as f:
            found[int(os.path.basename(path).split("-")[1])] = json.load(f)
    return found


def _events(workdir: str, name: str) -> list[dict[str, Any]]:
    [path] = glob.glob(os.path.join(workdir, "logs", "*", "events.jsonl"))  # <run id>/
    with open(path) as f:
        return [e for e in map(json.loads, f) if e["event"] == name]


def _run(workdir: str, flags: list[str], modules: str = MODULES,
         extra: dict[str, str] | None = None, await_import: str | None = None) -> str:
    """Two rounds: rank 0 fails after its imports (once ``await_import`` was preloaded)."""
    script, env = _layout(workdir, extra)
    wait = ["--await-server-import", await_import] if await_import else []
    with agents(workdir) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "1", "--max-restarts", "1",
                         "--log-dir", os.path.join(workdir, "logs"),
                         *flags], ["--dir", workdir, "--modules", modules, *wait],
                        name="n1", script=script, env=env)
        code = a.wait(agent, 300)
        out = a.output(agent)
    assert code == 0, out
    return out


@pytest.mark.slow
def test_next_round_finds_the_packages_the_workers_imported(tmp_path: object) -> None:
    workdir = str(tmp_path)
    # The fork server decides in the order the worker imported (MODULES): once it imported
    # slowpkg.lazy, the last one, everything was decided.
    out = _run(workdir, [], await_import="slowpkg.lazy")
    rec = _records(workdir)
    assert rec[0]["loaded_at_start"] == [], out
    assert rec[0]["import_seconds"]["slowpkg"] >= SLOW_IMPORT_S * 0.9
    # The restarted worker starts with the slow package imported: it does not pay its import.
    gpu_host = ["cudapkg"] if _driver_mapped() else []  # not refused there (see below)
    assert rec[1]["loaded_at_start"] == [*gpu_host, "slowpkg", "slowpkg.lazy"], out
    assert rec[1]["import_seconds"]["slowpkg"] < 0.1
    assert rec[1]["import_seconds"]["slowpkg.lazy"] < 0.1
    assert "preloaded for this round: slowpkg and 1 submodule(s)" in out
    assert "1 submodule(s) skipped (ImportError" in out
    assert "slowpkg.optional" not in out
    # Preloaded, but named: what its import read from the environment is the fork server's.
    assert "preloaded slowpkg, whose import looks up LOCAL_RANK: it saw the fork server's" in out
    # A package whose import starts a thread is refused (the fork server must stay fork-safe).
    assert "not preloaded: threadpkg: its import started a thread" in out, out
    # One whose import loads the CUDA driver too (a fork of it could not use CUDA). Where torch
    # maps the driver at import (a GPU host), loading it again changes nothing and is no refusal.
    if not _driver_mapped():
        assert "not preloaded: cudapkg: its import loaded the CUDA driver" in out, out
        assert "cudapkg" not in rec[1]["loaded_at_start"]
    [event] = _events(workdir, "preload")
    assert event["preloaded"] == ["slowpkg"]
    assert event["submodules"] == 1 and event["unavailable"] == 1
    assert event["env_reads"] == {"slowpkg": ["LOCAL_RANK"]}
    assert list(event["refused"]) == (["threadpkg"] if _driver_mapped() else ["threadpkg", "cudapkg"])
    assert "started a thread" in event["refused"]["threadpkg"]
    # The script's own modules and project code on PYTHONPATH are never preloaded (nor named).
    for name in ("projmod", "preload_localmod", "preload_job", "elasticstore"):
        assert name not in out.split("preloaded for this round:")[1].splitlines()[0]
        assert name not in event["refused"]


@pytest.mark.slow
def test_no_preload_imports_turns_it_off(tmp_path: object) -> None:
    workdir = str(tmp_path)
    out = _run(workdir, ["--no-preload-imports"], modules="slowpkg")
    rec = _records(workdir)
    assert rec[1]["loaded_at_start"] == [], out
    assert rec[1]["import_seconds"]["slowpkg"] >= SLOW_IMPORT_S * 0.9
    assert "preloaded" not in out
    assert _events(workdir, "preload") == []


@pytest.mark.slow
def test_fork_server_that_got_a_thread_is_replaced(tmp_path: object) -> None:
    """A package whose import starts a thread only sometimes (it passes the probe, then
    starts one in the fork server itself): that server forks no more; a fresh one starts the
    round, and the package is refused from then on."""
    workdir = str(tmp_path)
    flag = os.path.join(workdir, "imported-once")
    # Imported by the worker, then by the probe, then by the fork server: a thread the third time.
    sometimes = (f"import os, threading, time\nflag = {flag!r}\n"
                 "n = os.path.getsize(flag) if os.path.exists(flag) else 0\n"
                 "with open(flag, 'a') as f:\n"
                 "    f.write('x')\n"
                 "if n == 2:\n"
                 "    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n")
    out = _run(workdir, [], modules="sometimes", extra={"sometimes.py": sometimes},
               await_import="sometimes")
    assert "not preloaded: sometimes: its import started a thread" in out, out
    assert "the fork server is not safe to fork any more (sometimes: " in out, out
    assert sorted(_records(workdir)) == [0, 1]
    [event] = _events(workdir, "preload")
    assert event["tainted"].startswith("sometimes: ")


@pytest.mark.slow
def test_a_fork_server_taught_the_jobs_modules_imports_them_before_it_serves(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """What the agent of a node that joins a running job teaches its fork server (the run's
    list, ``share_imports``): the third-party modules are imported before the server answers,
    each checked as a worker's report is (one whose import starts a thread is refused); the
    standard library, project code and names of no module are not; the next report names
    every module preloaded (what this node would share in turn)."""
    workdir = str(tmp_path)
    _, env = _layout(workdir)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    server = ForkServer(True)
    try:
        assert teach(server, ["slowpkg", "slowpkg.lazy", "threadpkg", "json", "os.path",
                              "projmod", "no_such_module", "slowpkg.optional", "1x", "a..b"])
        with open(os.path.join(workdir, "imports.log")) as f:  # imported before the answer
            assert f"slowpkg.lazy {server.proc.pid} {os.getpid()}" in f.read().splitlines()
        assert held_names(server) == ["slowpkg", "slowpkg.lazy"]  # what this node would share
        report = server.preloads()
    finally:
        server.close()
    assert report is not None
    assert (report.preloaded, report.submodules) == (["slowpkg"], 1)
    assert list(report.refused) == ["threadpkg"], report.refused
    assert "started a thread" in report.refused["threadpkg"]
    assert report.unavailable == 1  # slowpkg.optional: ImportError, as in the workers


def _stand_in_of(server: int) -> bool:
    """Whether a copy of the fork server (its stand-in or a probe: the same command line) is
    among its children: it is importing in its idle time."""
    proc = pathlib.Path("/proc")
    title = (proc / str(server) / "cmdline").read_bytes()
    for child in (proc / str(server) / "task" / str(server) / "children").read_text().split():
        with contextlib.suppress(OSError):  # gone meanwhile
            if (proc / child / "cmdline").read_bytes() == title:
                return True
    return False


@pytest.mark.slow
def test_a_fork_server_busy_importing_is_taught_once_it_serves_again(
        tmp_path: object, monkeypatch: pytest.MonkeyPatch) -> None:
    """The list may come while the fork server imports in its idle time (``torch._dynamo``, 3 s
    after its start without a fork) and its stand-in answers: the stand-in says it is busy, and
    the agent asks again until the server itself imported the list."""
    workdir = str(tmp_path)
    _, env = _layout(workdir)
    monkeypatch.setenv("PYTHONPATH", env["PYTHONPATH"])
    server = ForkServer(True)
    try:
        deadline = time.monotonic() + 60
        while not _stand_in_of(server.proc.pid):
            assert time.monotonic() < deadline, "the fork server never imported in its idle time"
            time.sleep(0.02)
        assert teach(server, ["slowpkg", "slowpkg.lazy"])
        with open(os.path.join(workdir, "imports.log")) as f:
            assert f"slowpkg.lazy {server.proc.pid} {os.getpid()}" in f.read().splitlines()
    finally:
        server.close()


@pytest.mark.slow
def test_a_node_joining_a_running_job_starts_its_first_workers_with_the_jobs_imports(
        tmp_path: object) -> None:
    """Node A runs the job alone (nnodes 1:2): its first workers import the packages (and a
    submodule of torch, which the fork server had imported: reported too), its fork server
    preloads them, and at its next round A, rank 0, shares the list in the run's store. Node B,
    started then, has its fork server import that list before it joins: its first worker starts
    with them imported, and with the fork server's own deferred imports (torch._dynamo) too: B
    takes a place without paying their import, and says so."""
    workdir = str(tmp_path)
    script, env = _layout(workdir)
    port = free_port()
    common = ["--nnodes", "1:2", "--nproc-per-node", "1", "--max-restarts", "1",
              "--rdzv-endpoint", f"127.0.0.2:{port}", "--rdzv-id", "joins"]
    job = ["--dir", workdir, "--modules", "slowpkg,slowpkg.lazy,torch.utils.show_pickle,torch._dynamo",
           "--await-server-import", "slowpkg.lazy", "--hold-attempt", "1"]
    with agents(workdir) as a:
        first = a.start([*common, "--local-addr", "127.0.0.2"], job, name="a", script=script,
                        env=env)
        held = os.path.join(workdir, "preload-1-0.json")  # A's second round runs (and waits)
        deadline = time.monotonic() + 120
        while not os.path.exists(held):
            assert first.poll() is None and time.monotonic() < deadline, a.output(first)
            time.sleep(0.1)
        late = a.start([*common, "--local-addr", "127.0.0.3"], job, name="b", script=script,
                       env=env)
        assert a.wait(late, 120) == 0, a.output(late)
        assert a.wait(first, 60) == 0, a.output(first)
        out_a, out_b = a.output(first), a.output(late)
    with open(os.path.join(workdir, "preload-2-1.json")) as f:  # B's first worker (rank 1)
        record = json.load(f)
    # torch._dynamo: the fork server's own deferred import, done first when it is taught
    assert record["loaded_at_start"] == ["slowpkg", "slowpkg.lazy", "torch.utils.show_pickle",
                                         "torch._dynamo"], (out_a, out_b)
    assert record["import_seconds"]["slowpkg.lazy"] < 0.1
    assert "preloaded for this round: slowpkg and 2 submodule(s)" in out_b, out_b


def test_third_party_is_what_a_site_directory_holds(tmp_path: object) -> None:
    """The longest path entry holding the module decides: a site-packages directory (also one
    inside a project, as a virtual environment is) or not."""
    proj = str(tmp_path)
    site = os.path.join(proj, ".venv", "lib", "python3.11", "site-packages")
    dist = os.path.join(proj, "usr", "lib", "python3", "dist-packages")
    for d in (os.path.join(site, "pkg"), dist):
        os.makedirs(d)
    for path in (os.path.join(site, "pkg", "__init__.py"), os.path.join(dist, "mod.py"),
                 os.path.join(proj, "own.py")):
        open(path, "w").close()
    path = [proj, site, dist]
    for name, where, expect in (("pkg", site, os.path.join(site, "pkg")),
                                ("mod", dist, os.path.join(dist, "mod.py")),
                                ("own", proj, None)):
        spec = PathFinder.find_spec(name, [where])
        assert spec is not None
        assert third_party_origin(spec, path) == expect
    # Built-in and standard library modules are not third-party.
    assert third_party_origin(PathFinder.find_spec("json") or _no("json"), path) is None


def _no(name: str) -> Any:
    raise AssertionError(f"{name} not found")


def test_worker_variables_are_those_the_agent_sets() -> None:
    """The variables whose lookup at import is reported are those the agent sets per worker."""
    from types import SimpleNamespace

    from elasticstore.agent.config import AgentSettings
    from elasticstore.agent.envs import worker_env
    from elasticstore.agent.preload import WORKER_VARIABLES

    settings = AgentSettings(entrypoint="x.py", args=(), nproc=1, run_id="r", host="h",
                             token_file="/token")
    info = SimpleNamespace(bootstrap_store_info=None, rank=0, world_size=1)
    env = worker_env(settings, info, True, 0, 0, 0, 1, "/error.json")  # type: ignore[arg-type]
    set_by_agent = {k for k, v in env.items() if os.environ.get(k) != v}
    assert set_by_agent - {"TORCH_NCCL_ASYNC_ERROR_HANDLING"} <= WORKER_VARIABLES
    assert WORKER_VARIABLES <= set(env)


def test_no_preload_imports_flag_and_its_environment_variable() -> None:
    assert parse(["x.py"], {}).agent.preload_imports is True
    assert parse(["--no-preload-imports", "x.py"], {}).agent.preload_imports is False
    assert parse(["--no_preload_imports", "x.py"], {}).agent.preload_imports is False
    assert parse(["x.py"], {"PET_NO_PRELOAD_IMPORTS": "1"}).agent.preload_imports is False


def test_fork_server_modules_stay_small_and_standard_library_only() -> None:
    """The fork server runs as a script and loads its siblings by path: they import nothing
    from the package (and so never torch) before a worker runs."""
    agent_dir = os.path.join(ROOT, "python", "elasticstore", "agent")
    for name in ("forkserver.py", "preload.py", "importreport.py", "freshstate.py", "standin.py",
                 "warmrun.py"):
        with open(os.path.join(agent_dir, name)) as f:
            text = f.read()
        assert len(text.splitlines()) <= 400, name
        imports = [ln for ln in text.splitlines() if ln.startswith(("import ", "from "))]
        assert not [ln for ln in imports if ln.startswith("from .") or "elasticstore" in ln
                    or "torch" in ln], (name, imports)


DYNAMO_PROBE = """import json, os, sys
with open(os.path.join(sys.argv[1], os.environ["NODE_NAME"] + ".json"), "w") as f:
    json.dump({"dynamo_at_start": "torch._dynamo" in sys.modules}, f)
"""


@pytest.mark.slow
def test_a_node_whose_first_round_is_far_has_dynamo_preloaded_for_its_first_workers(
        tmp_path: object) -> None:
    """The fork server imports ``torch._dynamo`` (which any ``torch.optim`` optimizer imports)
    3 s after its start if it has forked nothing by then: a node whose first round is far (a
    standby, nodes still meeting; here a last call of 10 s) starts its first workers with it.
    (Before, it waited for the first fork: a standby's first workers paid that import.)"""
    workdir = str(tmp_path)
    script = os.path.join(workdir, "dynamo_probe.py")
    with open(script, "w") as f:
        f.write(DYNAMO_PROBE)
    with agents(workdir) as a:
        far = a.start(["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint",
                       f"127.0.0.2:{free_port()}", "--rdzv-id", "far", "--rdzv-conf",
                       "last_call_timeout=10"], [workdir], name="far", script=script,
                      env={"NODE_NAME": "far"})
        assert a.wait(far, 120) == 0, a.output(far)
    with open(os.path.join(workdir, "far.json")) as f:
        assert json.load(f) == {"dynamo_at_start": True}


OPTIMIZER = """import torch
torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)  # imports torch._dynamo
"""


def test_once_it_forked_a_fork_server_imports_its_guess_only_when_a_worker_did(
        tmp_path: object) -> None:
    """The fork server's guess (``torch._dynamo``) is for a node that has forked nothing yet:
    once a worker ran, it is imported only when a worker imported it (any optimizer does), as
    its own import (no probe). A worker that imports nothing new leaves nothing to import: no
    stand-in appears in the server's idle time (it would while the server imported), and the
    next worker starts without ``torch._dynamo``; after a worker that made an optimizer, the
    next starts with it."""
    workdir = str(tmp_path)
    probe, optimizer = os.path.join(workdir, "dynamo_probe.py"), os.path.join(workdir, "opt.py")
    for path, text in ((probe, DYNAMO_PROBE), (optimizer, OPTIMIZER)):
        with open(path, "w") as f:
            f.write(text)
    server = ForkServer(True)
    try:
        for name, script in (("first", probe), ("second", probe), ("optimizer", optimizer),
                             ("after", probe)):
            env = dict(os.environ, NODE_NAME=name)
            pid, status = server.start([script, workdir], env, workdir, "script",
                                       sys.stdout.fileno(), sys.stderr.fileno())
            with status:
                assert read_status(status) == 0
            deadline = time.monotonic() + 3.0  # the idle wait is 0.5 s, an import 1.5 s or more
            while name == "first" and time.monotonic() < deadline:
                assert not _stand_in_of(server.proc.pid), "the server imported after a fork"
                time.sleep(0.02)
            deadline = time.monotonic() + 120  # asked each 2 s: a request ends an idle time
            while name == "optimizer" and "torch._dynamo" not in held_names(server):
                assert time.monotonic() < deadline, "the reported guess was never imported"
                time.sleep(2.0)
    finally:
        server.close()
    for name, loaded in (("second", False), ("after", True)):
        with open(os.path.join(workdir, f"{name}.json")) as f:
            assert json.load(f) == {"dynamo_at_start": loaded}, name
