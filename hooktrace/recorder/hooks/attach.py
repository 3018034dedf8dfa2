"""How the recorder's hooks attach: process-wide module hooks and a table of recorded modules.

Nothing of hooktrace is stored in the user's modules. Hooks kept in a module's own hook
dicts travel with it: ``pickle``, ``torch.save(model)`` and ``copy.deepcopy`` (the EMA
pattern) would carry closures over the recorder (its locks and threads) and fail, and
``torch.jit.script`` would try to compile them. So the recorder registers two hooks common
to all modules (``torch.nn.modules.module.register_module_forward_pre_hook`` and
``register_module_forward_hook``), which look the module up in a :class:`ModuleTable` and
return at once for any module that is not recorded. A deep copy is a module of its own, not
in the table: it is not recorded under the original's names.

Why not the process-wide *backward* hooks as well: once one exists, PyTorch wraps every
module's inputs and outputs for backward in the whole process, which breaks in-place ops
after a module, ScriptModules and ``torch.jit.trace``. Gradients are caught on the recorded
tensors themselves (``Tensor.register_hook``), which pickling drops (a tensor is saved
without its hooks).

The hooks stay out of every graph that a script builds from its model: they return before
touching anything while dynamo compiles (``torch.compile``, ``torch.export``; the check must
come before the table lookup, which dynamo cannot trace), while ``torch.jit.trace`` or
``torch.fx.symbolic_trace`` traces, and inside ``torch.func`` transforms.

The cost: torch calls the process-wide hooks for every module call in the process, recorded
or not; for a module that is not recorded that is two dict look-ups and a flag read
(docs/PERFORMANCE.md).
"""

from __future__ import annotations

import sys
import types
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn
from torch.compiler import is_compiling
from torch.fx import _symbolic_trace
from torch.nn.modules import module as module_globals
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.hooks import RemovableHandle

try:
    from torch._C._functorch import peek_interpreter_stack as _peek_interpreter_stack
except ImportError:  # pragma: no cover - older torch
    _peek_interpreter_stack = None  # type: ignore[assignment]

__all__ = [
    "Attached",
    "ModuleTable",
    "call_kwargs",
    "elsewhere",
    "exporting",
    "in_backward",
    "in_transform",
    "install",
    "is_compiling",
    "traced",
]


class Attached:
    """What the recorder knows of one module it watches.

    ``name`` is None for a root whose own records are not wanted (filtered out): its calls
    still set the phase and open the step's parameter records. ``module`` is None for a
    tensor that ``hooktrace.watch`` names inside a compiled graph.
    """

    __slots__ = ("channels_first", "module", "name", "root")

    def __init__(
        self, module: nn.Module | None, name: str | None, *, channels_first: bool, root: bool
    ) -> None:
        self.module = module
        self.name = name
        self.channels_first = channels_first
        self.root = root


class ModuleTable:
    """The modules recorded, by ``id``: a dict look-up in the hot path, never the module's
    own attributes. An entry holds its module, so an id is never reused while it is here
    (the recorder holds its roots for the recording anyway)."""

    def __init__(self) -> None:
        self._by_id: dict[int, Attached] = {}
        # nn.DataParallel's per-device copies of a recorded module, called in its place
        self._replicas: dict[int, tuple[weakref.ref[nn.Module], Attached]] = {}

    def add(self, module: nn.Module, name: str | None, *, channels_first: bool) -> None:
        entry = self._by_id.get(id(module))
        if entry is None:
            self._by_id[id(module)] = Attached(
                module, name, channels_first=channels_first, root=False
            )
        elif entry.name is None:
            entry.name, entry.channels_first = name, channels_first

    def name(self, module: nn.Module, name: str, *, channels_first: bool) -> None:
        """Enter ``module`` under ``name``, or rename it (it moved within its model)."""
        entry = self._by_id.get(id(module))
        if entry is None:
            self.add(module, name, channels_first=channels_first)
        else:
            entry.name, entry.channels_first = name, channels_first

    def add_root(self, module: nn.Module) -> None:
        entry = self._by_id.get(id(module))
        if entry is None:
            self._by_id[id(module)] = Attached(module, None, channels_first=False, root=True)
        else:
            entry.root = True

    def get(self, module: nn.Module) -> Attached | None:
        entry = self._by_id.get(id(module))
        if entry is not None and entry.module is module:
            return entry
        if self._replicas:
            replica = self._replicas.get(id(module))
            if replica is not None and replica[0]() is module:
                return replica[1]
        return None

    def records_a(self, kind: type) -> bool:
        """Whether a module of this very type is recorded, a root or a module inside (of a
        compiled root, the type of the model it compiles)."""
        return any(
            type(getattr(entry.module, "_orig_mod", entry.module)) is kind
            for entry in self._by_id.values()
            if entry.name is not None or entry.root
        )

    def by_id(self, module_id: int) -> Attached | None:
        """The entry of the module with this id (a compiled graph names its modules by id)."""
        return self._by_id.get(module_id)

    def is_replica(self, module: nn.Module) -> bool:
        """Whether ``module`` is an nn.DataParallel replica (held weakly, gone after its
        forward)."""
        return id(module) in self._replicas

    def replica(self, replica: nn.Module, of: nn.Module) -> None:
        """``replica`` (made by ``nn.DataParallel`` on each forward) stands for ``of``; held
        weakly, it lives for its forward only."""
        entry = self.get(of)
        if entry is not None:
            self._replicas[id(replica)] = (weakref.ref(replica), entry)

    def drop_dead_replicas(self) -> None:
        if self._replicas:
            self._replicas = {k: v for k, v in self._replicas.items() if v[0]() is not None}

    def clear(self) -> None:
        self._by_id.clear()
        self._replicas.clear()

    def __len__(self) -> int:
        return len(self._by_id)


PreHook = Callable[[nn.Module, tuple[Any, ...]], None]
PostHook = Callable[..., None]

RAISED: Any = object()
"""The output a post hook is given where the forward raised (:func:`install`)."""


def install(*, pre: PreHook, post: PostHook) -> list[RemovableHandle]:
    """Register the two process-wide hooks; returns their handles.

    ``pre`` runs before every module's forward (before the module's own pre-hooks), ``post``
    after it (before the module's own forward hooks) as ``post(module, args, kwargs,
    output)``, and also when the forward raised, as ``post(module, args, None)``: its
    ``output`` is then :data:`RAISED` where it defaults to it. One hook, not a forward hook
    and one called always: each process-wide hook costs every module call of the process
    (docs/PERFORMANCE.md, ``bench_hooks.py``).
    """
    post_handle = register_module_forward_hook(post, with_kwargs=True, always_call=True)
    return [register_module_forward_pre_hook(pre), _forgetting_kwargs(post_handle)]


def _forgetting_kwargs(handle: RemovableHandle) -> RemovableHandle:
    """``handle``, whose removal also takes its hook's id out of torch's process-wide
    ``_global_forward_hooks_with_kwargs``: ``register_module_forward_hook`` puts it there
    and its handle leaves it behind, and with it torch.compile's wrapper warned of
    process-wide hooks at every call once a recording had ended."""
    flags = getattr(module_globals, "_global_forward_hooks_with_kwargs", None)
    extra = getattr(handle, "extra_dict_ref", None)
    if not isinstance(flags, dict) or not isinstance(extra, tuple):
        return handle  # another torch: as it is
    if not any(ref() is flags for ref in extra):  # (a torch that fixed it has it already)
        handle.extra_dict_ref = (*extra, weakref.ref(flags))
    return handle


def traced() -> bool:
    """True while ``torch.jit.trace`` or ``torch.fx.symbolic_trace`` runs the model: what the
    hooks would do would end up in the graph, or act on proxies."""
    return torch._C._get_tracing_state() is not None or _symbolic_trace._is_fx_tracing_flag


def exporting() -> bool:
    """True while ``torch.export`` traces the model: the flag export sets, read as a value.
    (torch 2.11's dynamo answers ``torch.compiler.is_exporting()`` with True inside every
    ``torch.compile`` trace: the marks were then left out and no module inside a compiled
    graph was recorded.)"""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def elsewhere() -> bool:
    """:func:`traced` or :func:`in_transform`, asked at once (every recorded module call asks)."""
    return (
        torch._C._get_tracing_state() is not None
        or _symbolic_trace._is_fx_tracing_flag
        or (_peek_interpreter_stack is not None and _peek_interpreter_stack() is not None)
    )


def in_transform() -> bool:
    """True inside torch.func transforms (vmap, grad, ...): their tensors are wrappers without
    storage, and what runs there is a function of the model, not a training step's pass."""
    return _peek_interpreter_stack is not None and _peek_interpreter_stack() is not None


def in_backward() -> bool:
    """True inside the autograd engine: a forward seen now is a checkpoint recomputation."""
    return bool(torch._C._current_graph_task_id() != -1)


def _inner_code() -> types.CodeType | None:
    for const in nn.Module._call_impl.__code__.co_consts:
        if isinstance(const, types.CodeType) and const.co_name == "inner":
            return const
    return None


_INNER = _inner_code()


def call_kwargs(*, depth: int = 8) -> Mapping[str, Any]:
    """The keyword arguments of the module call whose pre-hooks run now.

    torch gives process-wide pre-hooks the positional arguments only; they are called from
    ``Module._call_impl``'s ``inner``, whose locals hold both. Empty if that frame is not
    found within ``depth`` frames (another torch, where the kwargs are then not recorded).
    """
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            break
        if frame.f_code is _INNER:
            kwargs = frame.f_locals.get("kwargs")
            return kwargs if isinstance(kwargs, dict) else {}
        frame = frame.f_back  # type: ignore[assignment]
    return {}
