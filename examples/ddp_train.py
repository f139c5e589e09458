"""DistributedDataParallel trains a small MLP on synthetic data; the backend is a command-line choice.

    ringcomm-run -n 2 examples/ddp_train.py --backend ringcomm --save /tmp/ringcomm.pt
    ringcomm-run -n 2 examples/ddp_train.py --backend gloo     --save /tmp/gloo.pt
    torchrun --nproc-per-node 2 examples/ddp_train.py --backend ringcomm

The training script is the same for both backends: only the string given to
init_process_group changes. From the same --seed the two runs see the same data and the
same initial weights, so their losses and final parameters agree to float32 round-off.
Rank 0 prints the loss averaged over the ranks at every step, and with --save writes
the final parameters (a dict of tensors, torch.save).
"""
import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

IN, HIDDEN, OUT = 16, 64, 4


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=["ringcomm", "gloo"], default="ringcomm")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--batch", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bucket-cap-mb", type=float, default=0.01,
                   help="DDP bucket size; the default makes several buckets, so all-reduces overlap backward")
    p.add_argument("--save", default=None, help="rank 0 writes the final parameters here (torch.save)")
    return p.parse_args(argv)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.Tanh(),
                               torch.nn.Linear(HIDDEN, OUT))


def batch(seed: int, step: int, rank: int, world: int, per_rank: int):
    """This rank's share of step's global batch: the same global data whatever the backend."""
    w = torch.randn(IN, OUT, generator=torch.Generator().manual_seed(seed)) / IN ** 0.5  # fixed per seed
    g = torch.Generator().manual_seed(seed * 100_003 + step + 1)
    x = torch.randn(world * per_rank, IN, generator=g)
    y = x @ w + 0.5 * torch.sin(2 * x @ w)
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    return x[mine], y[mine]


def main(argv) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the cores; one thread each also keeps runs repeatable
    if args.backend == "ringcomm":
        import ringcomm.torch  # noqa: F401 - registers the "ringcomm" backend
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(make_model(args.seed), bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    for step in range(args.steps):
        x, y = batch(args.seed, step, rank, world, args.batch)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()  # DDP all-reduces the gradients, bucket by bucket, during backward
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step + 1:3d}  loss {mean.item() / world:.8f}", flush=True)
    if rank == 0 and args.save:
        torch.save({k: v.detach().clone() for k, v in model.module.state_dict().items()}, args.save)
        print(f"saved the final parameters to {args.save}")
    # Both ranks finish before the group goes, and DDP's reducer before the group it holds:
    # otherwise gloo's threads can die with "terminate called without an active exception".
    dist.barrier()
    del model, opt
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
