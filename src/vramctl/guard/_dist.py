"""Agreement between ranks: every rank retries when one ran out of memory, with the same split."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

__all__ = ["agree", "average_gradients", "distributed"]


def distributed() -> bool:
    """True inside an initialised process group of more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _comm_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(failed: bool, piece_limit: int) -> tuple[bool, int]:
    """One collective: did any rank fail, and the smallest piece size any rank needs."""
    # MAX over (failed, -limit): a failure anywhere, and the smallest limit.
    t = torch.tensor([int(failed), -piece_limit], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t[0].item()), int(-t[1].item())


def average_gradients(params: Sequence[torch.Tensor], bucket_bytes: int = 25 * 2**20) -> None:
    """Average the gradients over all ranks, as DistributedDataParallel's backward does.

    Gradients are packed into flat buckets of one dtype (about 25 MiB, DDP's
    default) and summed with ``all_reduce``; a parameter without a gradient on
    a rank contributes zeros.
    """
    world = dist.get_world_size()
    dev = _comm_device()
    groups: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in params:
        if p.requires_grad:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            groups.setdefault(p.grad.dtype, []).append(p)
    for plist in groups.values():
        bucket: list[torch.Tensor] = []
        size = 0
        for p in plist:
            bucket.append(p)
            size += p.grad.numel() * p.grad.element_size()  # type: ignore[union-attr]
            if size >= bucket_bytes:
                _reduce(bucket, world, dev)
                bucket, size = [], 0
        if bucket:
            _reduce(bucket, world, dev)


def _reduce(bucket: list[torch.Tensor], world: int, dev: torch.device) -> None:
    grads = [p.grad for p in bucket]
    flat = torch.cat([g.reshape(-1) for g in grads if g is not None]).to(dev)
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for g in grads:
        assert g is not None
        n = g.numel()
        g.copy_(flat[offset : offset + n].view_as(g))
        offset += n
