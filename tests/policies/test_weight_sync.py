"""Weights over a collective (``policies.weight_sync``): a real gloo group between processes on this machine."""

from __future__ import annotations

import io
import multiprocessing as mp
from typing import Any

import pytest
import torch

from reflow.policies.weight_sync import TensorSpec, WeightGroup, tensor_specs
from tests.conftest import free_port


def _receive(address: str, rank: int, world: int, specs: list[TensorSpec], out: Any) -> None:
    got = WeightGroup(address, rank, world).receive(specs)
    buffer = io.BytesIO()
    torch.save(got, buffer)  # as bytes: a tensor's shared memory would go with this process
    out.put((rank, buffer.getvalue()))


def test_rank_0_broadcasts_every_tensor_to_every_member_in_order() -> None:
    torch.manual_seed(0)
    weights = {"embed.weight": torch.randn(7, 5), "layer.bias": torch.randn(5).to(torch.bfloat16),
               "steps": torch.arange(4, dtype=torch.int64), "scalar": torch.tensor(3.5)}
    specs = tensor_specs(weights)
    assert specs[1] == TensorSpec("layer.bias", "bfloat16", (5,)) and specs[3].shape == ()
    address, ctx = f"127.0.0.1:{free_port()}", mp.get_context("spawn")
    out = ctx.Queue()
    members = [ctx.Process(target=_receive, args=(address, rank, 3, specs, out)) for rank in (1, 2)]
    for p in members:
        p.start()
    sent = WeightGroup(address, 0, 3).send(weights)
    assert sent == sum(t.numel() * t.element_size() for t in weights.values())
    received = {rank: torch.load(io.BytesIO(data)) for rank, data in (out.get(timeout=60) for _ in members)}
    for p in members:
        p.join(timeout=60)
    assert sorted(received) == [1, 2]
    for got in received.values():
        assert list(got) == list(weights)
        assert all(got[n].dtype == weights[n].dtype and torch.equal(got[n], weights[n]) for n in weights)


def test_bad_groups_are_refused_with_their_reason() -> None:
    with pytest.raises(ValueError, match="'gloo' or 'nccl'"):
        WeightGroup("127.0.0.1:1", 0, 1, backend="mpi")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rank 2 is outside a group of 2"):
        WeightGroup("127.0.0.1:1", 2, 2)
    alone = WeightGroup(f"127.0.0.1:{free_port()}", 0, 1)
    with pytest.raises(RuntimeError, match="the engines receive"):
        alone.receive([])
    assert alone.send({"w": torch.ones(2)}) == 8  # a group of one: nothing to wait for
