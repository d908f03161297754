"""Weights over a collective: the trainer's rank 0 broadcasts each tensor to every engine.

How verl and OpenRLHF move weights into vLLM engines on GPUs: a process
group of its own between the trainer's rank 0 (rank 0 of the group) and each
engine (rank ``1 + i``), separate from vLLM's and from the trainer's FSDP
group; the trainer broadcasts one tensor after another, each engine receives
into buffers of the same names, dtypes and shapes (``TensorSpec``, agreed
once when the group forms) and loads them in place. ``gloo`` on CPU tensors
(the path this machine runs and tests), ``nccl`` on CUDA tensors (the GPU
path: the same calls, NCCL between devices; it needs each rank on a device of
its own, and is tested only where GPUs are, ``tests/infra/test_weight_sync_gpu.py``).

The group is built from a ``TCPStore`` at an address the trainer's rank 0
serves, with ``torch.distributed``'s process-group classes directly, so
neither side's default group is touched. Every member must construct it at
the same time (the store waits for all of them). A group cannot take a new
member: an engine restarted by Ray has left it, and the next broadcast fails
after ``timeout_s`` (the run fails; ``reflow resume`` builds a new group).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

Backend = Literal["gloo", "nccl"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the weights as both sides agree on it before any broadcast."""

    name: str
    dtype: str  # torch dtype name, e.g. "float32"
    shape: tuple[int, ...]


def tensor_specs(weights: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    """The specs of ``weights``, in their order (the order every broadcast follows)."""
    return [TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in weights.items()]


class WeightGroup:
    """Rank ``rank`` of a ``world``-member broadcast group served at ``address`` (``host:port``; rank 0 serves it)."""

    def __init__(self, address: str, rank: int, world: int, backend: Backend = "gloo",
                 timeout_s: float = 300.0) -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight group backend must be 'gloo' or 'nccl', got {backend!r}")
        if not 0 <= rank < world:
            raise ValueError(f"weight group rank {rank} is outside a group of {world}")
        host, _, port = address.rpartition(":")
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store = dist.TCPStore(host, int(port), world, is_master=rank == 0, timeout=timeout)
        self.rank, self.world, self.backend = rank, world, backend
        if backend == "gloo":
            self.group = dist.ProcessGroupGloo(self.store, rank, world, timeout)
            self.device = torch.device("cpu")
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(self.store, rank, world, options)
            self.device = torch.device("cuda", torch.cuda.current_device())

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.group.broadcast([tensor], opts).wait()

    def send(self, weights: Mapping[str, torch.Tensor]) -> int:
        """Rank 0: broadcast every tensor of ``weights`` in order; returns the bytes sent to each member."""
        if self.rank != 0:
            raise RuntimeError("only rank 0 (the trainer) sends weights")
        sent = 0
        for tensor in weights.values():
            tensor = tensor.detach().to(self.device).contiguous()
            self._broadcast(tensor)
            sent += tensor.numel() * tensor.element_size()
        if self.backend == "nccl":
            torch.cuda.synchronize()
        return sent

    def receive(self, specs: Sequence[TensorSpec]) -> dict[str, torch.Tensor]:
        """Rank > 0: the tensors rank 0 broadcasts, in ``specs``' order, on this rank's device."""
        if self.rank == 0:
            raise RuntimeError("rank 0 sends weights; the engines receive them")
        out = {}
        for spec in specs:
            tensor = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=self.device)
            self._broadcast(tensor)
            out[spec.name] = tensor
        if self.backend == "nccl":
            torch.cuda.synchronize()
        return out
