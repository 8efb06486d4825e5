"""One program, launched from Python with torch's elastic_launch or elasticstore's (the only
difference is the import): ``launch_api.py torch|elasticstore ok|fail|command PORT OUT [START_METHOD]``.

ok: 2 workers run ``trainer`` (an all_reduce over gloo) and return a value; fail: rank 1 raises;
flaky: rank 1 raises in the first round only (one restart allowed);
command: the workers run this file as a script (``worker``); logs: as ok, with torch's
DefaultLogsSpecs (the log files' paths are reported); filters: as logs, with a
duplicate_stdout_filters. Writes what elastic_launch returned,
or the ChildFailedError's failures, to OUT as JSON."""

from __future__ import annotations

import json
import os
import sys


def trainer(scale: int, tag: str, marker: str = "") -> dict[str, object]:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    if tag == "fail" and dist.get_rank() == 1:
        # Its group destroyed first (a local call): a fresh interpreter that ends with gloo's
        # threads alive may abort in its teardown (exit -6, "terminate called without an active
        # exception"), as torch's own launcher's worker did in one run; a warm worker ends without
        # that teardown (docs/agent.md, warm start), so the exit codes would differ by chance.
        dist.destroy_process_group()
        raise ValueError("rank 1 fails on purpose")
    if tag == "flaky" and dist.get_rank() == 1 and not os.path.exists(marker):
        open(marker, "w").close()
        raise ValueError("rank 1 fails once")
    if tag == "fail":  # stopped by the launcher because rank 1 failed: not a failure of its own
        import time

        time.sleep(60)
    print(f"trainer rank {dist.get_rank()} says hello", flush=True)
    out = {"rank": dist.get_rank(), "world": dist.get_world_size(), "sum": t.item() * scale,
           "tag": tag, "local_rank": int(os.environ["LOCAL_RANK"]),
           "warm": "ELASTICSTORE_FORKED_AT" in os.environ}  # forked by elasticstore's fork server
    if tag != "fail":  # (a destroy would wait for rank 1, which failed)
        dist.destroy_process_group()
    return out


def main() -> None:
    which, mode, port, out = sys.argv[1:5]
    start_method = sys.argv[5] if len(sys.argv) > 5 else "spawn"
    if which == "torch":
        # torch's c10d rendezvous shares its TCPStore with the workers by default, and a restart's
        # workers can then hang or fail in init_process_group on the earlier round's address (the
        # reference run stalled for 240 s on a loaded machine): the reference runs without sharing.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    else:
        from elasticstore.launcher import LaunchConfig, elastic_launch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logs_specs = None
    if mode in ("logs", "filters"):  # torch's DefaultLogsSpecs: every stream to files, stdout teed
        from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std

        logs_specs = DefaultLogsSpecs(log_dir=out + ".logs", redirects=Std.ALL, tee=Std.OUT)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=2, run_id=f"api-{mode}",
                          logs_specs=logs_specs,
                          duplicate_stdout_filters=["rank 1 says"] if mode == "filters" else None,
                          rdzv_backend="c10d", rdzv_endpoint=f"127.0.0.1:{port}",
                          max_restarts=1 if mode == "flaky" else 0, monitor_interval=0.1,
                          start_method=start_method)
    try:
        if mode == "command":
            result = elastic_launch(config, sys.executable)("-u", __file__, "worker")
        else:
            result = elastic_launch(config, trainer)(10, mode, out + ".marker")
        report: dict[str, object] = {"result": {str(k): v for k, v in sorted(result.items())}}
        if logs_specs is not None:  # the files under <log dir>/<run id>_<random>/
            (run_dir,) = [d for d in os.listdir(out + ".logs") if d.startswith(f"api-{mode}_")]
            root = os.path.join(out + ".logs", run_dir)
            report["files"] = sorted(os.path.relpath(os.path.join(d, f), root)
                                     for d, _, files in os.walk(root) for f in files)
            with open(os.path.join(root, "attempt_0", "1", "stdout.log")) as f:
                report["stdout_1"] = f.read()
            if mode == "filters":
                with open(os.path.join(root, "attempt_0", "filtered_stdout.log")) as f:
                    report["filtered"] = f.read()
    except ChildFailedError as exc:
        report = {"failed": exc.name, "failures": {
            str(rank): {"exitcode": f.exitcode, "message": f.message.get("message", "")
                        if isinstance(f.message, dict) else str(f.message)}
            for rank, f in sorted(exc.failures.items())}}
    with open(out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    if sys.argv[1:] == ["worker"]:
        print(f"command worker rank {os.environ['RANK']}", flush=True)
    else:
        main()
