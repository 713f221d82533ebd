"""A plain torchrun-style DDP script (no hpar import, no hpar contract): it joins the process
group itself, wraps its model in DistributedDataParallel and shards the data with a
DistributedSampler. Runs unmodified with ``torchrun --nproc-per-node 2 examples/ddp_digits.py``
or ``hpar launch examples/ddp_digits.py --epochs 3`` (hpar's options go before the script).

Data: the 1,797 8x8 handwritten digits bundled with scikit-learn (no download): 1,500 train,
297 validate, after a fixed shuffle. Device-agnostic: one GPU per process with NCCL where CUDA
is present (LOCAL_RANK picks it), CPU with gloo otherwise. Rank 0 prints the loss of every
``--log-every`` steps and the validation accuracy after every epoch; with ``--checkpoint FILE``
it saves a checkpoint after every epoch and every rank resumes from it when started again
(``hpar launch --max-restarts N``).
"""

import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def digits():
    """(train, validation) TensorDatasets of images (N, 1, 8, 8) in [0, 1] and labels (N,)."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(1234))
    x, y = x[order], y[order]
    return TensorDataset(x[:1500], y[:1500]), TensorDataset(x[1500:], y[1500:])


def build_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(16 * 4 * 4, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="samples per process per step")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--log-every", type=int, default=10)
    parser.add_argument("--checkpoint", default=None, help="checkpoint file (saved every epoch, resumed from)")
    parser.add_argument("--step-sleep", type=float, default=0.0, help="seconds to sleep per step (tests)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    model = DistributedDataParallel(build_model().to(device), device_ids=[local_rank] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    start = 0
    if args.checkpoint and os.path.exists(args.checkpoint):
        state = torch.load(args.checkpoint, map_location=device, weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
        if rank == 0:
            print(f"resumed from {args.checkpoint} at epoch {start}", flush=True)

    train, valid = digits()
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    step = 0
    for epoch in range(start, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % args.log_every == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
            if args.step_sleep:
                import time

                time.sleep(args.step_sleep)
        if rank == 0:
            model.eval()
            with torch.no_grad():
                x, y = valid.tensors
                accuracy = (model(x.to(device)).argmax(1).cpu() == y).float().mean().item()
            print(f"epoch {epoch} validation accuracy {accuracy:.4f}", flush=True)
            if args.checkpoint:
                tmp = args.checkpoint + ".tmp"
                torch.save({"model": model.module.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch}, tmp)
                os.replace(tmp, args.checkpoint)
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
