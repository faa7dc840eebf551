"""Training script for tests/test_contract_distributed.py: one file, run by ``python`` and by
``torchrun``.

``python _distributed_train.py OUT`` trains with FastDataParallel on two CPU replicas;
``torchrun --nproc_per_node 2 _distributed_train.py OUT`` trains with DDP (gloo) on two processes.
A last argument ``zero`` makes the optimizer ``fastdp.ZeroRedundancyOptimizer`` (torch's under
torchrun). Rank 0 saves the final bare state dict, the global loss of every step and the types of
the wrapper and the optimizer.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import fastdp


def main(out_path: str, zero: bool) -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    model = fastdp.wrap(net, device_ids=["cpu", "cpu"])
    if zero:  # the same line gives fastdp's class in one process, torch's under torchrun
        opt = fastdp.ZeroRedundancyOptimizer(
            model.parameters(), optimizer_class=torch.optim.SGD, lr=0.2, momentum=0.9
        )
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    data = torch.Generator().manual_seed(1)  # every rank draws the same global batches
    losses = []
    for _ in range(6):
        x = torch.randn(16, 8, generator=data)
        y = torch.randint(0, 4, (16,), generator=data)
        xs, ys = fastdp.shard_batch((x, y))
        loss = F.cross_entropy(model(xs), ys)
        opt.zero_grad()
        loss.backward()
        opt.step()
        global_loss = loss.detach().clone()
        if dist.is_initialized():
            dist.all_reduce(global_loss)
            global_loss /= dist.get_world_size()
        losses.append(global_loss.item())
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(
            {
                "state": fastdp.unwrap(model).state_dict(),
                "losses": losses,
                "wrapper": type(model).__name__,
                "optimizer": f"{type(opt).__module__}.{type(opt).__name__}",
            },
            out_path,
        )
    if dist.is_initialized():
        dist.destroy_process_group()
        # gloo threads at interpreter exit: destroy_process_group does not join gloo's
        # worker threads, and one may still be freeing the last collective's work (tensors that
        # Python owns) when the interpreter finalizes; taking the GIL then kills the thread inside
        # a noexcept destructor: std::terminate, "terminate called without an active exception"
        # (torch's bug: pytorch issue #190489, PR #179291). Everything is written: skip
        # finalization.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] == ["zero"])
