"""Runs benchmark children in a fresh interpreter (workers.py's ``fresh=``): for clients that
cannot live in a forked copy of the measuring process (etcd's gRPC client).

Started by fork + exec from the measuring process with two arguments: a descriptor holding the
pickled ``(prepare, entries)``, and the entries' pipes (comma-separated descriptors, where a
failure before the children start is reported). ``prepare()`` runs first (it imports the client, once for every
child); each entry ``(fn, w, args)`` then runs as ``fn(w, *args)`` (workers.child_main) in a
child of its own, forked here before any client exists, so nothing of a client crosses a fork.
This process waits for its children and dies with the measuring process (PR_SET_PDEATHSIG, kept
across exec), and its children with it.
"""

from __future__ import annotations

import os
import pickle
import sys

import workers


def main() -> None:
    writers = [int(fd) for fd in sys.argv[2].split(",")]
    try:
        with os.fdopen(int(sys.argv[1]), "rb") as f:
            prepare, entries = pickle.load(f)
        prepare()
    except BaseException:
        for w in writers:  # every child's reader sees why
            workers.send_error(w)
        raise
    if len(entries) == 1:
        fn, w, args = entries[0]
        workers.child_main(w, fn, args)
    pids = []
    for fn, w, args in entries:
        pid = os.fork()
        if pid == 0:
            for _, other, _ in entries:
                if other != w:
                    os.close(other)
            workers.child_main(w, fn, args)
        pids.append(pid)
    for _, w, _ in entries:
        os.close(w)
    for pid in pids:
        os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
