"""A fresh interpreter that forks benchmark children on request (workers.py's ``fresh=``): for
clients that cannot live in a forked copy of the measuring process (etcd's gRPC client).

Started once per ``prepare`` function by fork + exec from the measuring process, with one
argument: the descriptor of its end of a Unix socket pair (SOCK_SEQPACKET: one message per
request). The first message is the pickled ``prepare``, run once (it imports the client, for
every child of the run); the reply is ``b"ok"`` or an ``E`` frame with the traceback. Then each
request is ``("fork", entries)`` with descriptors attached (SCM_RIGHTS): an entry ``(fn, w, args)``
runs as ``fn(w, *args)`` (workers.child_main) in a child of its own, where ``w`` and every
``workers.Fd(i)`` in ``args`` stand for the i-th attached descriptor; the reply is the children's
pids. ``("reap", pids)`` waits for those children (the measuring process killed them or read
their results) and replies ``b"ok"``: a child's pid stays this process's until it is reaped here,
so the measuring process never signals a pid that was reused. Children are forked before any
client exists in this process, so nothing of a client crosses a fork. This process ends when the
measuring process closes the socket or dies (PR_SET_PDEATHSIG, kept across exec), and its
children with it (theirs is set in child_main).
"""

from __future__ import annotations

import os
import pickle
import socket
import sys

import workers

MAX_MESSAGE = 1 << 20
MAX_FDS = 256


def _fork(conn: socket.socket, entries: list, fds: list[int]) -> list[int]:
    pids = []
    for fn, w, args in entries:
        keep = {fds[w], *(fds[a.index] for a in args if isinstance(a, workers.Fd))}
        args = tuple(fds[a.index] if isinstance(a, workers.Fd) else a for a in args)
        pid = os.fork()
        if pid == 0:
            try:
                conn.close()
                for fd in set(fds) - keep:  # the other children's pipe ends: their EOF is theirs
                    os.close(fd)
            except BaseException:
                os._exit(1)
            workers.child_main(fds[w], fn, args)
        pids.append(pid)
    return pids


def main() -> None:
    conn = socket.socket(fileno=int(sys.argv[1]))
    try:
        prepare = pickle.loads(conn.recv(MAX_MESSAGE))
        prepare()
    except BaseException:
        conn.send(workers.error_frame())  # the measuring process raises it as ChildFailed
        sys.exit(1)
    conn.send(b"ok")
    for _ in range(1 << 30):
        msg, fds, _flags, _addr = socket.recv_fds(conn, MAX_MESSAGE, MAX_FDS)
        if not msg:  # the measuring process closed its end
            return
        fds = list(fds)
        try:
            verb, arg = pickle.loads(msg)
            if verb == "fork":
                reply = pickle.dumps(_fork(conn, arg, fds))
            else:  # "reap"
                for pid in arg:
                    try:
                        os.waitpid(pid, 0)
                    except ChildProcessError:
                        pass
                reply = b"ok"
        except BaseException:
            reply = workers.error_frame()
        finally:
            for fd in fds:
                os.close(fd)
        conn.send(reply)


if __name__ == "__main__":
    main()
