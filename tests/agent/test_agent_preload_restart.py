"""A restart never waits for a preload in progress: while the fork server imports what the
workers imported, a copy of it taken before the import (its stand-in) forks the next round's
workers, which start without the package (never with a half-imported one); once the import ended
the workers start with it.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from agent_nodes import agents

SERVER_IMPORT_S = 6.0  # the fork server's own import of the package (not the worker's, not the probe's)

# Imported by a worker (RANK set): at once. Outside a worker, the first time (the fork server's
# probe) at once, the second time (the fork server itself) slowly; it logs start and end.
PACKAGE = """\
import os, time
log = {log!r}
def say(what):
    with open(log, 'a') as f:
        f.write(json.dumps({{'what': what, 'pid': os.getpid(), 'at': time.time()}}) + '\\n')
import json
if 'RANK' not in os.environ:
    n = os.path.getsize({count!r}) if os.path.exists({count!r}) else 0
    with open({count!r}, 'a') as f:
        f.write('x')
    if n == 1:
        say('start')
        time.sleep({seconds})
        say('end')
"""

# attempt 0: imports the package, waits until the fork server began importing it, dies;
# attempt 1 (forked while the server imports): records, waits until the import ended, dies;
# attempt 2 (forked after it): records and ends.
SCRIPT = """\
import json, os, sys, time
started = time.time()
at_start = 'slowpkg' in sys.modules
import slowpkg
d = sys.argv[1]
attempt = os.environ['TORCHELASTIC_RESTART_COUNT']
with open(os.path.join(d, f'attempt-{attempt}.json'), 'w') as f:
    json.dump({'started': started, 'loaded_at_start': at_start, 'pid': os.getpid(),
               'ppid': os.getppid()}, f)
def wait_for(what):
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(d, 'server.log')) as f:
                if any(json.loads(line)['what'] == what for line in f):
                    return
        except FileNotFoundError:
            pass
        time.sleep(0.02)
if attempt == '0':
    wait_for('start')
    with open(os.path.join(d, 'died.json'), 'w') as f:
        json.dump({'at': time.time()}, f)
    sys.exit(1)
def importing(server):  # a copy of the fork server (its stand-in, a probe) is its child
    def cmdline(pid):
        try:
            with open(f'/proc/{pid}/cmdline', 'rb') as f:
                return f.read()
        except OSError:
            return b''
    for task in os.listdir(f'/proc/{server}/task'):
        with open(f'/proc/{server}/task/{task}/children') as f:
            if any(int(p) != os.getpid() and cmdline(p) == cmdline(server) for p in f.read().split()):
                return True
    return False
if attempt == '1':
    wait_for('end')  # and then until the fork server is done importing: it forks again itself
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and importing(os.getppid()):
        time.sleep(0.05)
    sys.exit(1)
"""


def _read(path: str) -> Any:
    with open(path) as f:
        return json.load(f)


@pytest.mark.slow  # ~15 s: torch's import in the fork server, the 6 s import, three rounds
def test_restart_during_a_preload_does_not_wait_for_it(tmp_path: object) -> None:
    workdir = str(tmp_path)
    site = os.path.join(workdir, "env", "lib", "site-packages")
    os.makedirs(os.path.join(site, "slowpkg"))
    log = os.path.join(workdir, "server.log")
    with open(os.path.join(site, "slowpkg", "__init__.py"), "w") as f:
        f.write(PACKAGE.format(log=log, count=os.path.join(workdir, "count"),
                               seconds=SERVER_IMPORT_S))
    script = os.path.join(workdir, "job.py")
    with open(script, "w") as f:
        f.write(SCRIPT)
    env = {"PYTHONPATH": os.pathsep.join([site, os.environ.get("PYTHONPATH", "")])}
    with agents(workdir) as a:
        agent = a.start(["--standalone", "--nproc-per-node", "1", "--max-restarts", "2"],
                        [workdir], name="n1", script=script, env=env)
        code = a.wait(agent, 300)
        out = a.output(agent)
    assert code == 0, out
    with open(log) as f:
        server = {e["what"]: e for e in map(json.loads, f)}
    died, first, second = (_read(os.path.join(workdir, n))
                           for n in ("died.json", "attempt-1.json", "attempt-2.json"))
    # The fork server (the workers' parent) imported it, and the restart came while it did.
    assert server["start"]["pid"] == first["ppid"] == second["ppid"], out
    assert first["started"] < server["end"]["at"], out
    assert first["started"] - died["at"] < SERVER_IMPORT_S / 2, out
    # Forked from the state before the import: the package is not there, not even in part.
    assert first["loaded_at_start"] is False, out
    # Once the import ended, the next workers start with it.
    assert second["started"] > server["end"]["at"]
    assert second["loaded_at_start"] is True, out
    assert "preloaded for this round: slowpkg" in out, out
