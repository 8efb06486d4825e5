"""The console as workers see it, side by side with torchrun (real launchers, real workers):
under a terminal a worker sees a terminal and a progress bar's carriage-return updates show
live, the prefix after every one; with a pipe, whole prefixed lines; torch's
TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE and -t prefix with --role; --log-layout torchrun writes
torchrun's log directory layout."""

from __future__ import annotations

import fcntl
import glob
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from elasticstore.agent.console import ConsoleWriter, Sink

BIN = os.path.dirname(sys.executable)
# torchrun beside elasticstore-run, on the same command and the same checks (slow: torchrun
# imports torch afresh in every worker, 5-10 s a run on a loaded 2-core machine).
LAUNCHERS = ["elasticstore", pytest.param("torchrun", marks=pytest.mark.slow)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launcher_argv(launcher: str) -> list[str]:
    """The launcher's command; torchrun on a free port (its default 29500 may be taken)."""
    if launcher == "torchrun":
        return [os.path.join(BIN, "torchrun"), f"--master-port={_free_port()}"]
    return [sys.executable, "-m", "elasticstore.run", "--local-addr", "127.0.0.2"]


# Says what it sees, then draws a bar (carriage returns, no newline) and holds it until the test
# saw it (the file "release"), then ends the line.
BAR = r"""
import os, sys, time
rank = os.environ["RANK"]
size = os.get_terminal_size(1).columns if sys.stdout.isatty() else 0
print(f"sees tty={sys.stdout.isatty()},{sys.stderr.isatty()} columns={size}", flush=True)
for i in range(3):
    sys.stdout.write(f"\rbar {i}/3 of rank {rank}")
    sys.stdout.flush()
deadline = time.monotonic() + 60
while not os.path.exists("release") and time.monotonic() < deadline:
    time.sleep(0.02)
print(f"\nbar done of rank {rank}", flush=True)
"""
COLUMNS = 120


class Pty:
    """A launcher whose stdout and stderr are a pseudo-terminal of COLUMNS columns."""

    def __init__(self, argv: list[str], cwd: str, env: dict[str, str]) -> None:
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, COLUMNS, 0, 0))
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=slave, stderr=slave,
                                     cwd=cwd, env=env, start_new_session=True)
        os.close(slave)
        self.data = b""

    def read_until(self, pattern: bytes, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not re.search(pattern, self.data) and time.monotonic() < deadline:
            if not select.select([self.master], [], [], 0.05)[0]:
                continue
            try:
                chunk = os.read(self.master, 1 << 16)
            except OSError:  # EIO: the launcher and its workers are gone
                break
            if not chunk:
                break
            self.data += chunk
        return re.search(pattern, self.data) is not None

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)
        os.close(self.master)


@contextmanager
def under_pty(launcher: str, flags: list[str], script: str, cwd: str) -> Iterator[Pty]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    p = Pty([*launcher_argv(launcher), *flags, script], cwd, env)
    try:
        yield p
    finally:
        p.close()


def _script(tmp: str, text: str = BAR) -> str:
    path = os.path.join(tmp, "bar.py")
    with open(path, "w") as f:
        f.write(text)
    return path


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_under_a_terminal_workers_see_one_and_a_bar_updates_live(tmp_path: object, launcher: str) -> None:
    tmp = str(tmp_path)
    with under_pty(launcher, ["--nproc-per-node", "2"], _script(tmp), tmp) as p:
        # The bar shows while the workers wait: not held back until a newline.
        live = p.read_until(rb"bar 2/3 of rank 0.*|bar 2/3 of rank 1", 90)
        live = live and p.read_until(rb"bar 2/3 of rank 0", 30) and p.read_until(rb"bar 2/3 of rank 1", 30)
        open(os.path.join(tmp, "release"), "w").close()
        assert live, p.data.decode(errors="replace")
        assert p.read_until(rb"bar done of rank 0(.|\n)*bar done of rank 1|bar done of rank 1(.|\n)*bar done of rank 0", 60)
        assert p.proc.wait(60) == 0, p.data.decode(errors="replace")
    out = p.data.decode(errors="replace")
    seen = re.findall(r"sees tty=(\w+),(\w+) columns=(\d+)", out)
    assert len(seen) == 2 and all(s[:2] == ("True", "True") for s in seen), out
    if launcher == "torchrun":
        assert {int(s[2]) for s in seen} == {COLUMNS}, out
        return
    # Each rank's bar is prefixed after every carriage return, and its terminal is narrower by
    # the prefix: an updated line never wraps.
    for rank in (0, 1):
        prefix = f"[127.0.0.2:{rank}] "
        for i in range(3):
            assert f"\r{prefix}bar {i}/3 of rank {rank}" in out, repr(out)
    assert {int(s[2]) for s in seen} == {COLUMNS - len("[127.0.0.2:0] ")}, out
    # No line holds two workers' text.
    for line in re.split(r"[\r\n]", out):
        assert len(re.findall(r"\[127\.0\.0\.2:\d\]", line)) <= 1, repr(line)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_with_a_pipe_workers_see_no_terminal_and_output_is_whole_lines(tmp_path: object, launcher: str) -> None:
    tmp = str(tmp_path)
    open(os.path.join(tmp, "release"), "w").close()
    done = subprocess.run([*launcher_argv(launcher), "--nproc-per-node", "2", _script(tmp)], cwd=tmp,
                          capture_output=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    out = done.stdout.decode()
    assert out.count("sees tty=False,False columns=0") == 2, out
    if launcher == "elasticstore":
        for rank in (0, 1):
            assert (f"[127.0.0.2:{rank}] \rbar 0/3 of rank {rank}\rbar 1/3 of rank {rank}"
                    f"\rbar 2/3 of rank {rank}\n") in out, repr(out)
            assert f"[127.0.0.2:{rank}] bar done of rank {rank}\n" in out, repr(out)


# torch's launcher test (test_capture_logs_using_default_logs_specs): launch.main in-process,
# its output captured with redirect_stdout, the prefix from the template.
IN_PROCESS = r"""
import contextlib, io, os, sys
argv = sys.argv[2:]
if sys.argv[1] == "torchrun":
    from torch.distributed.run import main
else:
    from elasticstore.run import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    main(argv)
sys.__stdout__.write(out.getvalue())
"""
SH = 'echo "creating $RANK"; printf "no newline $RANK"'
# torchrun's tee leaves a last line without its newline unfinished (the next rank's line then
# continues it): compared on whole lines only.
SH_LINES = 'echo "creating $RANK"; echo "on stderr $RANK" >&2'


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("template", ["[rank${rank}]: ", None])
def test_prefix_template_and_tee_role_prefix_as_torchrun(tmp_path: object, template: str | None,
                                                         launcher: str) -> None:
    tmp = str(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE", None)
    if template is not None:
        env["TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE"] = template
    flags = ["--nproc-per-node", "2", "--redirects", "3", "--tee", "3", "--role", "trainer",
             "--monitor-interval", "0.1", "--no-python", "--log-dir", os.path.join(tmp, "logs")]
    flags += ([f"--master-port={_free_port()}"] if launcher == "torchrun" else
              ["--local-addr", "127.0.0.2"])
    done = subprocess.run([sys.executable, "-c", IN_PROCESS, launcher, *flags, "/bin/sh", "-c", SH_LINES],
                          cwd=tmp, capture_output=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    lines = sorted(done.stdout.decode().splitlines())
    # What torchrun prints (its stderr lines go to the captured stderr, not checked here).
    if template:
        assert lines == ["[rank0]: creating 0", "[rank1]: creating 1"], lines
    else:
        assert lines == ["[trainer0]:creating 0", "[trainer1]:creating 1"], lines


def _tree(root: str) -> list[str]:
    found = []
    for path in glob.glob(os.path.join(root, "**", "*"), recursive=True):
        if os.path.isfile(path):
            found.append(os.path.relpath(path, root))
    return sorted(found)


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_log_layout_torchrun_writes_torchruns_directories(tmp_path: object, launcher: str) -> None:
    tmp = str(tmp_path)
    logs = os.path.join(tmp, "logs")
    flags = ["--nproc-per-node", "2", "--rdzv-id", "job7", "--redirects", "3", "--log-dir", logs,
             "--no-python"]
    if launcher == "elasticstore":
        flags.insert(0, "--log-layout=torchrun")
    done = subprocess.run([*launcher_argv(launcher), *flags, "/bin/sh", "-c", SH], cwd=tmp,
                          capture_output=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    # <log dir>/<run id>_<random>/attempt_<n>/<local rank>/ (elasticstore-run's events.jsonl
    # stays in <log dir>/<run id>/)
    runs = glob.glob(os.path.join(logs, "job7_*"))
    assert len(runs) == 1, os.listdir(logs)
    assert _tree(runs[0]) == [f"attempt_0/{local}/{name}.log" for local in (0, 1)
                              for name in ("stderr", "stdout")], _tree(runs[0])
    for local in (0, 1):
        with open(os.path.join(runs[0], "attempt_0", str(local), "stdout.log")) as f:
            assert f.read() == f"creating {local}\nno newline {local}"


class _Terminal:
    """A text stream that says it is a terminal (what the writers see of one)."""

    def __init__(self) -> None:
        self.text = ""

    def isatty(self) -> bool:
        return True

    def write(self, text: str) -> None:
        self.text += text

    def flush(self) -> None:
        pass


def test_terminal_writer_prefixes_after_each_carriage_return_and_ends_a_bar_before_others_write() -> None:
    term = _Terminal()
    sink = Sink(term)
    a, b = ConsoleWriter(sink, "[h:0] "), ConsoleWriter(sink, "[h:1] ")
    a.chunk(b"\r 10%|#")
    a.chunk(b"#|\r 50%|")  # continues its own unfinished line: no prefix in the middle
    b.chunk(b"log line\n")  # another worker: the bar is ended first, left as it stands
    a.chunk(b"\r 90%|")
    a.line(b"whole line")  # a teed stream of the same worker (pipe): a line of its own
    a.close()
    assert term.text == ("\r[h:0]  10%|##|\r[h:0]  50%|\n[h:1] log line\n\r[h:0]  90%|\n"
                         "[h:0] whole line\n"), repr(term.text)
