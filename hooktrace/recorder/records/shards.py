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
from collections.abc import Iterable
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


def data_parallel(models: Iterable[Any]) -> dict[str, int] | None:
    """This rank's place among the data-parallel ranks, ``{"size": S, "rank": R}`` (the ranks
    of one ``R`` hold the same part of the global batch: tensor parallelism's peers), for the
    analyzer's logical view: from a model's DistributedDataParallel wrapper, or from FSDP2's
    own data-parallel mesh (its shard and replicate dimensions); size 1 for a model with
    DTensor parameters over a mesh of every rank and neither (tensor parallelism alone). None where that cannot be
    told (no process group; data parallelism by hand): the analyzer then judges from the
    records themselves."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return None
    models = list(models)
    for model in models:
        if type(model).__name__ == "DistributedDataParallel":
            group = model.process_group
            return {"size": dist.get_world_size(group), "rank": dist.get_rank(group)}
    fsdp = sys.modules.get("torch.distributed.fsdp")
    whole_world = False  # DTensor parameters over a mesh of every rank: no data parallelism
    for model in models:
        for module in model.modules():
            if fsdp is not None and isinstance(module, fsdp.FSDPModule):
                group = module._get_fsdp_state()._fsdp_param_group
                if group is not None:  # a module of no parameters of its own has none
                    return _place(group.mesh_info.mesh)
            for p in module.parameters(recurse=False):
                if dtensor(p):
                    whole_world = whole_world or p.device_mesh.size() == dist.get_world_size()
    return {"size": 1, "rank": 0} if whole_world else None


def _place(mesh: Any) -> dict[str, int]:
    """This rank's flat index in ``mesh`` (row-major), and the mesh's size."""
    coordinate = mesh.get_coordinate() or [0] * mesh.ndim
    index = 0
    for size, at in zip(mesh.shape, coordinate, strict=True):
        index = index * size + at
    return {"size": mesh.size(), "rank": index}


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
    return tensor._local_tensor, described(tensor._spec)


def described(spec: Any) -> Shard:
    """:func:`describe`, remembered by spec (the same parameters come back every step)."""
    found = _described.get(spec)
    if found is None:
        found = describe(spec)
        if len(_described) < 4096:
            _described[spec] = found
    return found


def describe(spec: Any) -> Shard:
    """The shard columns of a DTensor of ``spec`` on this rank."""
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
