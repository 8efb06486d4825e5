"""A worker script for the preloading tests: records which of the given modules were already
imported when it started (the fork server preloaded them) and how long importing them took.

``--dir D --modules a,b.c,?d``: imports each (after noting which are in ``sys.modules``; ``?``: an
ImportError is expected and ignored), writes ``preload-<attempt>-<rank>.json`` to D, then rank 0
exits 1 in attempt 0 (a restart).
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
attempt, rank = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
path = os.path.join(args.dir, f"preload-{attempt}-{rank}.json")
with open(path + ".tmp", "w") as f:
    json.dump({"loaded_at_start": loaded, "import_seconds": took}, f)
os.replace(path + ".tmp", path)
sys.exit(1 if attempt == "0" and rank == "0" else 0)
