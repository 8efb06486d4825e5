"""A warm-started worker that uses CUDA: records whether CUDA was initialised before the script
ran and whether its parent (the fork server) has the CUDA driver mapped, then initialises CUDA
itself, runs a matmul on the device and (``--backend nccl``, one worker per device) an NCCL
all_reduce, else a gloo all_reduce of the result. ``--fail-rank R`` exits 3 in attempt 0 after
the CUDA work, so the restarted round forks from the same fork server again.

Writes ``cuda-<attempt>-<rank>.json`` into ``--dir``.
"""

import argparse
import json
import os
import sys
import time

_PRELOADED = "torch" in sys.modules


def _maps_cuda(pid: int) -> bool:
    """The CUDA driver library is mapped (``import torch`` may load it: not an initialisation)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return "libcuda.so" in f.read()
    except OSError:
        return False


def _opened_gpu(pid: int) -> bool:
    """CUDA was initialised in ``pid``: cuInit opens and maps /dev/nvidia* device files."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            if "/dev/nvidia" in f.read():
                return True
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}").startswith("/dev/nvidia"):
                    return True
            except OSError:
                pass
    except OSError:
        return False
    return False


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--backend", default="gloo")
    p.add_argument("--fail-rank", type=int, default=-1)
    args = p.parse_args()
    import torch
    import torch.distributed as dist

    rank, attempt = int(os.environ["RANK"]), int(os.environ.get("ELASTICSTORE_ATTEMPT") or os.environ["TORCHELASTIC_RESTART_COUNT"])
    local = int(os.environ["LOCAL_RANK"])
    info = {"rank": rank, "attempt": attempt, "pid": os.getpid(), "preloaded": _PRELOADED,
            "cuda_initialised_at_start": bool(torch.cuda.is_initialized()),
            "parent_maps_libcuda": _maps_cuda(os.getppid()),
            "parent_opened_gpu": _opened_gpu(os.getppid()), "parent": os.getppid()}
    t0 = time.monotonic()
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    a = torch.randn(2048, 2048, device=device)
    b = (a @ a).sum()
    torch.cuda.synchronize()
    info["cuda_first_op_seconds"] = time.monotonic() - t0
    dist.init_process_group(args.backend)
    if args.backend == "nccl":
        t = torch.ones(1, device=device) * (rank + 1)
        dist.all_reduce(t)
        info["all_reduce"] = float(t.item())
    else:
        t = torch.tensor([float(b.item() != 0)])
        dist.all_reduce(t)
        info["all_reduce"] = float(t.item())
    info["device"] = torch.cuda.get_device_name(device)
    info["opened_gpu"] = _opened_gpu(os.getpid())  # the probe itself: it must see its own
    info["parent_opened_gpu_after"] = _opened_gpu(info["parent"])
    dist.destroy_process_group()
    with open(os.path.join(args.dir, f"cuda-{attempt}-{rank}.json"), "w") as f:
        json.dump(info, f)
    if rank == args.fail_rank and attempt == 0:
        sys.exit(3)


if __name__ == "__main__":
    main()
