"""Nested inputs and outputs flattened into (slot, tensor) pairs.

A slot says where a tensor sits: ``0`` for a bare tensor or the first positional argument,
``logits`` for a dict key, ``past_key_values.0.1`` for nesting. Non-tensor leaves (None, ints,
strings) hold no tensor and produce no slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import torch

MAX_DEPTH = 16  # guards against self-referencing structures


def flatten(value: Any, prefix: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(slot, tensor)`` for every tensor in ``value``, depth first, in order."""
    yield from _walk(value, prefix, 0)


def flatten_call(
    args: tuple[Any, ...], kwargs: Mapping[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Slots of a call's inputs: positional arguments by index, keyword arguments by name."""
    for i, arg in enumerate(args):
        yield from _walk(arg, str(i), 0)
    for key, arg in kwargs.items():
        yield from _walk(arg, str(key), 0)


def _walk(value: Any, slot: str, depth: int) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(value, torch.Tensor):
        yield (slot or "0"), value
        return
    if depth >= MAX_DEPTH or value is None or isinstance(value, (str, bytes, int, float, bool)):
        return
    if isinstance(value, Mapping):
        items: Any = value.items()
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        items = ((f.name, getattr(value, f.name)) for f in dataclasses.fields(value))
    elif isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        items = zip(value._fields, value, strict=True)
    elif isinstance(value, (tuple, list)):
        items = enumerate(value)
    else:
        return
    for key, item in items:
        child = f"{slot}.{key}" if slot else str(key)
        yield from _walk(item, child, depth + 1)


# -- call specs: a call's structure, for replay --------------------------------------------
#
# A JSON description of args and kwargs in which each tensor is replaced by its slot (the
# same slots flatten_call yields) and plain values are kept: replay rebuilds the call from it
# and the saved input tensors. Values that JSON cannot hold are described by their type.


def describe_call(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """A tensor passed twice (``attn(x, x, x)``) points at its first slot each time, and a
    tensor whose memory layout is not contiguous keeps its strides (dropout draws its mask in
    memory order, so replaying it on a contiguous copy would drop other elements)."""
    seen: dict[int, str] = {}
    return {
        "args": [_describe(arg, str(i), 0, seen) for i, arg in enumerate(args)],
        "kwargs": {str(key): _describe(arg, str(key), 0, seen) for key, arg in kwargs.items()},
    }


def _describe(value: Any, slot: str, depth: int, seen: dict[int, str]) -> Any:
    if isinstance(value, torch.Tensor):
        first = seen.setdefault(id(value), slot or "0")
        described: dict[str, Any] = {"tensor": first}
        if value.layout == torch.strided and not value.is_contiguous() and 0 not in value.stride():
            described["stride"] = list(value.stride())
        return described
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if value == value and abs(value) != float("inf") else {"float": repr(value)}
    if depth >= MAX_DEPTH:
        return {"opaque": type(value).__qualname__}
    if isinstance(value, Mapping) and all(isinstance(k, str) for k in value):
        return {
            "dict": {
                k: _describe(v, f"{slot}.{k}" if slot else k, depth + 1, seen)
                for k, v in value.items()
            }
        }
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        items = [
            _describe(v, f"{slot}.{i}" if slot else str(i), depth + 1, seen)
            for i, v in enumerate(value)
        ]
        return {"tuple": items} if isinstance(value, tuple) else {"list": items}
    return {"opaque": type(value).__qualname__}


def rebuild_call(
    spec: Mapping[str, Any], tensors: Mapping[str, Any]
) -> tuple[list[Any], dict[str, Any]]:
    """The inverse of describe_call: args and kwargs with each slot's tensor put back (the
    same object where the call passed one tensor twice, with its recorded strides).

    Raises KeyError naming a slot whose tensor is missing, and ValueError for a value that
    was not recorded (an object JSON cannot hold).
    """
    args = [_rebuild(a, tensors) for a in spec["args"]]
    kwargs = {k: _rebuild(v, tensors) for k, v in spec["kwargs"].items()}
    return args, kwargs


def _rebuild(value: Any, tensors: Mapping[str, Any]) -> Any:
    if not isinstance(value, dict):
        return value
    if "tensor" in value:
        tensor = tensors[value["tensor"]]
        if "stride" in value and isinstance(tensor, torch.Tensor):
            layout = torch.empty_strided(
                tensor.shape, value["stride"], dtype=tensor.dtype, device=tensor.device
            )
            return layout.copy_(tensor)
        return tensor
    if "float" in value:
        return float(value["float"])
    if "dict" in value:
        return {k: _rebuild(v, tensors) for k, v in value["dict"].items()}
    if "tuple" in value:
        return tuple(_rebuild(v, tensors) for v in value["tuple"])
    if "list" in value:
        return [_rebuild(v, tensors) for v in value["list"]]
    raise ValueError(
        f"an argument of type {value.get('opaque', '?')} was not recorded and cannot be replayed"
    )
