"""Which call of a module a hook sees, and the gradient hooks on the tensors it recorded.

Calls are counted per (phase, module) within a micro-step: a module called twice (a shared
module, an RNN cell in a loop) records calls 0 and 1, and the gradients that reach its
outputs later are recorded under the same numbers. Gradients are caught on the recorded
tensors themselves (``Tensor.register_hook``; :mod:`hooktrace.recorder.hooks.attach` says why not
the process-wide backward hooks), one hook a tensor.

Apart from the recorder because this bookkeeping lives for one micro-step (the end of a
backward pass clears it) and holds the recorder's only references to the step's tensors:
weak ones, and hook handles, which keep no tensor alive.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from hooktrace.recorder.records.flatten import flatten

_PRUNE_AT = 64
"""Gradient hook handles held before the dead ones are dropped, at least."""

Target = tuple[str, int, str, str]
"""Where a gradient is recorded: (module, call, kind, slot)."""

HookFor = Callable[[list[Target]], Callable[[torch.Tensor], None]]
"""Makes a tensor's gradient hook, which records the gradient as each of its targets."""

Handle = tuple["weakref.ref[dict[int, Any]]", int]
"""A gradient hook to remove: the tensor's hooks (held weakly) and the hook's key there."""


class Calls:
    """The calls counted and the gradients hooked in the current micro-step, and the
    handles of every gradient hook still to remove."""

    _hooked: dict[int, tuple[weakref.ref[torch.Tensor], int, int, list[Target]]]

    def __init__(self) -> None:
        self.handles: list[Handle] = []
        self._prune_at = _PRUNE_AT
        self.new_step()

    def new_step(self) -> None:
        self.counts: dict[tuple[str, str], int] = {}  # by (phase, module): calls so far
        self._recomputed: dict[str, int] = {}
        self.grad_hooked: set[tuple[str, int]] = set()  # (module, call)
        # by id(tensor): the tensor, its version, its gradient hook's id, what that records
        self._hooked = {}
        self.output_specs: dict[tuple[str, int], str] = {}  # of calls with no tensor input

    def backward_done(self) -> None:
        """A backward pass completed: the next forward begins a micro-step."""
        self.counts.clear()
        self.grad_hooked.clear()
        self._hooked.clear()
        self._recomputed.clear()

    def count(self, phase: str, name: str) -> int:
        """The number of this call of ``name`` in ``phase``, counted."""
        key = (phase, name)
        call = self.counts.get(key, 0)
        self.counts[key] = call + 1
        return call

    def peek(self, phase: str, name: str) -> int:
        """The number the next call of ``name`` in ``phase`` will be counted as."""
        return self.counts.get((phase, name), 0)

    def hook_grad(self, tensor: torch.Tensor, target: Target, hook_for: HookFor) -> None:
        """Record ``tensor``'s gradient as ``target``. One hook a tensor: one returned again
        unchanged (a container's output is its last child's) takes one more target in the
        hook it has, not a hook of its own; unless another hook came after ours, which may
        change the gradient that the later module's record must see."""
        hooked = self._hooked.get(id(tensor))
        if hooked is not None:
            seen, version, ours, targets = hooked
            hooks = tensor._backward_hooks
            # the same tensor, unchanged, and our hook still the last one on it
            if seen() is tensor and tensor._version == version and _last(hooks) == ours:
                targets.append(target)
                return
        targets = [target]
        hook = hook_for(targets)
        # tensor.register_hook(hook), as torch does it for a tensor that requires a gradient
        # (the callers check), without the handle object torch makes for each; keys come
        # from torch's own counter, so that they never meet the script's hooks'. A
        # subclass's __torch_function__ does not see it, as none sees the recorder's other
        # calls (hooks._unseen)
        hooks = tensor._backward_hooks
        grad_fn = tensor.grad_fn
        if hooks is None:
            hooks = tensor._backward_hooks = OrderedDict()
            if grad_fn is not None:
                grad_fn._register_hook_dict(tensor)
        key = RemovableHandle.next_id
        RemovableHandle.next_id = key + 1
        # a leaf (a watched parameter) keeps its hooks from one backward to the next: a
        # leaf's hook runs once
        hooks[key] = hook if grad_fn is not None else _Once(hook, hooks, key)
        self.handles.append((weakref.ref(hooks), key))
        self._hooked[id(tensor)] = (weakref.ref(tensor), tensor._version, key, targets)

    def recomputed(self, name: str, output: Any, hook_for: HookFor) -> None:
        """A forward run again by activation checkpointing: record nothing twice.

        Non-reentrant checkpointing keeps the original graph, whose hooks already fire. The
        reentrant kind ran the original forward under no_grad, so gradients reach only the
        recomputed outputs: hook those, under the original call's index.
        """
        call = self._recomputed.get(name, 0)
        self._recomputed[name] = call + 1
        if (name, call) in self.grad_hooked:
            return
        for slot, tensor in flatten(output):
            if tensor.requires_grad:
                self.grad_hooked.add((name, call))
                self.hook_grad(tensor, (name, call, "grad_output", slot), hook_for)

    def prune(self) -> None:
        """The gradient hooks of a graph that is gone need no removing: their handles are
        dropped at a step's end (a handle keeps no tensor alive) once there are 64, or twice
        as many as were alive the last time. Kept for many steps, each would be alive at a
        young collection and counted towards the next full one (``layout.MetaRow``): with
        1,024 kept, 400 of them a step on the 200-layer benchmark; a script that keeps its
        graphs (``losses.append(loss)``) does not have them all walked every step."""
        if len(self.handles) >= self._prune_at:
            self.handles = [h for h in self.handles if _alive(h)]
            self._prune_at = max(_PRUNE_AT, 2 * len(self.handles))

    def remove(self) -> None:
        for hooks, key in self.handles:
            alive = hooks()
            if alive is not None:
                alive.pop(key, None)
        self.handles.clear()


class _Once:
    """A gradient hook that removes itself (``key`` in the tensor's ``hooks``) when it first
    runs."""

    __slots__ = ("hook", "hooks", "key")

    def __init__(self, hook: Callable[[torch.Tensor], Any], hooks: dict[int, Any], key: int):
        self.hook, self.hooks, self.key = hook, hooks, key

    def __call__(self, grad: torch.Tensor) -> None:
        self.hooks.pop(self.key, None)
        self.hook(grad)


def _last(hooks: Mapping[int, Any] | None) -> int | None:
    """The id of the hook registered last among ``hooks`` (a tensor's ``_backward_hooks``)."""
    return next(reversed(hooks)) if hooks else None


def _alive(handle: Handle) -> bool:
    return handle[0]() is not None
