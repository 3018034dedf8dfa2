"""A distributed tensor's local shard, and what it is a part of.

A DTensor (FSDP2's parameters and gradients, tensor parallelism's weights and activations)
holds on each rank a plain tensor, its local shard, and a spec: the logical tensor's shape,
the device mesh, and a placement per mesh dimension. The recorder summarises the local
shard, in the hook, without a collective and without waiting for a device, and the record's
shard columns (``schema.SHARD_COLUMNS``) say what it is a part of, so that the analyzer can
put the logical tensor's statistics back together from every rank's records.

Reading the local shard is reading an attribute: nothing is dispatched through the DTensor,
so that no operation of hooktrace's reaches the distributed machinery. The result of a
collective still running (an AsyncCollectiveTensor) is read once it is done: the wait its
first use would make anyway, made a little earlier.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from hooktrace.recorder.records.layout import shape_text

Shard = tuple[str, str, str, str, str]
"""The shard columns' values: logical shape, mesh shape, mesh coordinate, placements, offset."""

_described: dict[Any, Shard] = {}
"""Descriptions by spec: the same parameters come back every step."""


def dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (without importing torch.distributed where the script
    has not)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def pending_collective(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is the result of a collective that may still be running (an
    AsyncCollectiveTensor: tensor parallelism's outputs after a reduction, such as
    RowwiseParallel's)."""
    module = sys.modules.get("torch.distributed._functional_collectives")
    return module is not None and isinstance(tensor, module.AsyncCollectiveTensor)


def collected(tensor: Any) -> torch.Tensor:
    """The values of a pending collective's result, once it is done: the wait its first use
    in the script would make (idempotent: that use then waits no more; on a GPU the current
    stream waits, the host does not), so the values are the script's own."""
    return tensor.trigger_wait()


def local_shard(tensor: Any) -> tuple[torch.Tensor, Shard]:
    """The DTensor's local shard, and its shard columns."""
    spec = tensor._spec
    described = _described.get(spec)
    if described is None:
        described = _describe(spec)
        if len(_described) < 4096:
            _described[spec] = described
    return tensor._local_tensor, described


def _describe(spec: Any) -> Shard:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = spec.mesh, spec.placements
    shape = tuple(spec.shape)
    coordinate = mesh.get_coordinate()
    offset: tuple[int, ...] = ()
    if coordinate is not None:  # a rank outside the mesh holds nothing
        _, offset = compute_local_shape_and_global_offset(shape, mesh, placements)
    return (
        shape_text(shape),
        shape_text(tuple(mesh.shape)),
        shape_text(tuple(coordinate or ())),
        ",".join(_placement(p) for p in placements),
        shape_text(tuple(offset)),
    )


def _placement(placement: Any) -> str:
    """``S(0)``, ``R``, ``P(sum)``; a strided shard (FSDP2 with tensor parallelism) as
    ``_S(0,2)``: along dimension 0, split ``2`` ways first."""
    if placement.is_replicate():
        return "R"
    if placement.is_partial():
        return f"P({getattr(placement, 'reduce_op', 'sum')})"
    split = getattr(placement, "split_factor", None)
    if split is not None:
        return f"_S({placement.dim},{split})"
    if placement.is_shard():
        return f"S({placement.dim})"
    return str(placement)
