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
