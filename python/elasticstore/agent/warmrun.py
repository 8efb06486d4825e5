"""What a worker forked warm by the fork server (``forkserver.py``) runs: the script or module
as ``__main__``, in the state a fresh ``python -u script.py`` (``-m mod``) starts in, ended as
that interpreter would end.

Standard library only: the fork server (run as a script) loads this file by its path.
"""

from __future__ import annotations

import builtins
import io
import os
import signal
import sys
import types
from typing import Any

__all__ = ["run"]


def run(job: dict[str, Any], fresh: Any, report: Any) -> None:
    """Runs the script or module as ``__main__`` in the process state of a fresh ``python -u
    script.py`` / ``python -u -m mod`` (path, argv, environment, random seeds), then ends the
    process as its interpreter would: never returns."""
    os.environ.clear()
    os.environ.update(job["env"])
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))  # OpenMP read the variable when torch was loaded
    fresh.reseed(torch)
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    argv = list(job["argv"])
    module = job["kind"] == "module"
    fresh.set_title([sys.executable, "-u", *(["-m"] if module else []), *argv])
    sys.argv = argv
    first = os.getcwd() if module else os.path.dirname(os.path.abspath(argv[0]))
    sys.path[:] = fresh.fresh_path(job["path"], job["pythonpath"], first)
    os.environ["ELASTICSTORE_FORKED_AT"] = repr(job["forked_at"])
    if job.get("imports") is not None:  # tells the fork server what this worker imports
        sys.meta_path.insert(0, report.ImportReporter(job["imports"]))
    main_module = types.ModuleType("__main__")  # as the interpreter creates it
    main_module.__dict__.update(__annotations__={}, __builtins__=builtins)
    sys.modules["__main__"] = main_module  # the script's globals live until the process ends
    code = 0
    try:
        if module:
            import runpy

            runpy._run_module_as_main(argv[0], alter_argv=True)  # type: ignore[attr-defined]
        else:
            _run_script(main_module, os.path.abspath(argv[0]))
    except SystemExit as exc:
        code = fresh.exit_code(exc)
    except BaseException as exc:  # reported as the interpreter reports it
        tb = exc.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename == run.__code__.co_filename:
            tb = tb.tb_next  # the traceback starts where a fresh interpreter's starts
        exc.__traceback__ = tb
        sys.last_type, sys.last_value, sys.last_traceback = type(exc), exc, tb
        sys.excepthook(type(exc), exc, tb)
        code = -signal.SIGINT if isinstance(exc, KeyboardInterrupt) else 1
    fresh.finalize(code)


def _run_script(main_module: types.ModuleType, path: str) -> None:
    """``python path``: the file's code in ``__main__`` (a directory or zip: runpy's way)."""
    import importlib.machinery

    if not os.path.isfile(path) or path.endswith((".zip", ".pyz")):
        import runpy

        runpy.run_path(path, run_name="__main__")
        return
    with io.open_code(path) as f:
        source = f.read()
    code = compile(source, path, "exec", dont_inherit=True)
    main_module.__dict__.update(
        __file__=path, __cached__=None, __package__=None, __spec__=None,
        __loader__=importlib.machinery.SourceFileLoader("__main__", path))
    exec(code, main_module.__dict__)
