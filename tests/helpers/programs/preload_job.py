"""A worker script for the preloading tests: records which of the given modules were already
imported when it started (the fork server preloaded them) and how long importing them took.

``--dir D --modules a,b.c,?d``: imports each (after noting which are in ``sys.modules``; ``?``: an
ImportError is expected and ignored), writes ``preload-<attempt>-<rank>.json`` to D, then rank 0
exits 1 in attempt 0 (a restart). ``--await-server-import NAME``: rank 0 of attempt 0 first waits
until ``D/imports.log`` (where the test's packages write ``name pid ppid`` when imported) shows
NAME imported by its parent, the fork server (the fork server preloaded it).
"""

import argparse
import json
import os
import sys
import time

_AT_START = set(sys.modules)

parser = argparse.ArgumentParser()
parser.add_argument("--dir", required=True)
parser.add_argument("--modules", required=True)
parser.add_argument("--await-server-import", default=None)
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
    sys.exit(1)
