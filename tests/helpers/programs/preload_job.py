"""A worker script for the preloading tests: records which of the given modules were already
imported when it started (the fork server preloaded them) and how long importing them took.

``--dir D --modules a,b.c,?d``: imports each (after noting which are in ``sys.modules``; ``?``: an
ImportError is expected and ignored), writes ``preload-<attempt>-<rank>.json`` to D, then rank 0
exits 1 in attempt 0 (a restart). ``--await-server-import NAME``: rank 0 of attempt 0 first waits
until ``D/imports.log`` (where the test's packages write ``name pid ppid`` when imported) shows
NAME imported by its parent, the fork server, and the fork server is done importing (no copy of
it, its stand-in or a probe, is among its children). ``--hold-attempt N``: rank 0 of attempt N
waits (at most 300 s) once it wrote its record, until its agent stops it (another node joins).
"""

import argparse
import json
import os
import sys
import time

_AT_START = set(sys.modules)


def importing(server: int) -> bool:
    """Whether the fork server is in its idle imports: a copy of it (same command line) is among
    its children (the stand-in that serves meanwhile, or a probe); this worker is not one."""
    def cmdline(pid: object) -> bytes:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return f.read()
        except OSError:
            return b""

    title = cmdline(server)
    for task in os.listdir(f"/proc/{server}/task"):
        with open(f"/proc/{server}/task/{task}/children") as f:
            if any(int(p) != os.getpid() and cmdline(p) == title for p in f.read().split()):
                return True
    return False

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--modules", required=True)
parser.add_argument("--await-server-import", default=None)
parser.add_argument("--hold-attempt", default=None)
args = parser.parse_args()
names = args.modules.split(",")
loaded = [n for n in names if n in _AT_START]
took = {}
for name in names:
    t0 = time.monotonic()
    try:
        __import__(name.lstrip("?"))
    except ImportError:
        if not name.startswith("?"):
            raise
    took[name] = time.monotonic() - t0
attempt, rank = os.environ.get("ELASTICSTORE_ATTEMPT") or os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
path = os.path.join(args.dir, f"preload-{attempt}-{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"loaded_at_start": loaded, "import_seconds": took}, f)
os.replace(path + ".tmp", path)
if attempt == args.hold_attempt and rank == "0":
    time.sleep(300)
if attempt == "0" and rank == "0":
    if args.await_server_import:
        wanted = f"{args.await_server_import} {os.getppid()} "
        log = os.path.join(args.dir, "imports.log")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if os.path.exists(log):
                with open(log) as f:
                    if any(line.startswith(wanted) for line in f):
                        break
            time.sleep(0.05)
        while time.monotonic() < deadline and importing(os.getppid()):
            time.sleep(0.05)
    sys.exit(1)
