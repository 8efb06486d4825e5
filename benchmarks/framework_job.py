"""A training job for ``frameworks.py``: a tiny model trained with plain torch DDP, Lightning's
``Trainer(strategy="ddp")`` or Hugging Face's ``Trainer`` (gloo, CPU), until ``<dir>/stop``
exists. Each worker writes ``start-<attempt>-<rank>.json`` (its pid) when it starts and
``step-<attempt>-<rank>`` (wall time) at its first training step.

    python framework_job.py --framework {torch,lightning,hf} --dir D
"""

import argparse
import json
import os
import time

STEP_SLEEP_S = 0.05  # per step: the job idles, as one waiting on data would

parser = argparse.ArgumentParser()
parser.add_argument("--framework", required=True, choices=["torch", "lightning", "hf"])
parser.add_argument("--dir", required=True)
args = parser.parse_args()
ATTEMPT, RANK = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["RANK"]
WORLD = int(os.environ["WORLD_SIZE"])
with open(os.path.join(args.dir, f"start-{ATTEMPT}-{RANK}.json"), "w") as f:
    json.dump({"pid": os.getpid(), "attempt": int(ATTEMPT), "world": WORLD}, f)
_first = [True]


def on_step() -> bool:
    """Called at each step's start; True: stop training."""
    if _first[0]:
        _first[0] = False
        path = os.path.join(args.dir, f"step-{ATTEMPT}-{RANK}")
        with open(path + ".tmp", "w") as f:
            f.write(repr(time.time()))
        os.replace(path + ".tmp", path)
    time.sleep(STEP_SLEEP_S)
    return os.path.exists(os.path.join(args.dir, "stop"))


def run_torch() -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    while not on_step():
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()
    dist.destroy_process_group()


def run_lightning() -> None:
    import lightning as L
    import torch

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def training_step(self, batch: torch.Tensor, idx: int) -> torch.Tensor:
            return self.layer(batch).sum()

        def on_train_batch_start(self, batch: object, idx: int) -> int | None:
            return -1 if on_step() else None  # -1: Lightning ends the epoch

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    data = torch.utils.data.DataLoader(torch.randn(100_000, 8), batch_size=4)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
                        max_epochs=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Model(), data)


def run_hf() -> None:
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 1)

        def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
            return {"loss": torch.nn.functional.mse_loss(self.layer(x).squeeze(-1), labels)}

    class Steps(TrainerCallback):
        def on_step_begin(self, a: object, state: object, control: object, **kw: object) -> None:
            if on_step():
                control.should_training_stop = True  # type: ignore[attr-defined]

    data = [{"x": torch.randn(8), "labels": torch.randn(())} for _ in range(4096)]
    targs = TrainingArguments(output_dir=os.path.join(args.dir, f"hf-{RANK}"), max_steps=100_000,
                              per_device_train_batch_size=4, use_cpu=True, report_to=[],
                              save_strategy="no", logging_strategy="no", ddp_backend="gloo",
                              dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=Model(), args=targs, train_dataset=data, callbacks=[Steps()]).train()


{"torch": run_torch, "lightning": run_lightning, "hf": run_hf}[args.framework]()
