"""What the recorder changes in torch while it records, and puts back when it ends.

The process-wide hooks (:mod:`hooktrace.recorder.hooks.attach`) see every module call, but
two kinds of call go around them: ``nn.DataParallel`` calls per-device copies of the module,
made each forward; and ``torch.jit.trace`` runs the model again to check its graph, which is
no call of the run. Compiled graphs are instrumented where dynamo hands them to their
backend (:mod:`hooktrace.recorder.graphs`). The recorder patches those places, and the
question by which torch.compile's wrapper decides to warn that process-wide hooks exist.
Each of these, unlike the hooks, changes torch itself; all are undone in one place
(:meth:`Patches.undo`) however the recording ends.
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from hooktrace.recorder.hooks.attach import ModuleTable

_OUTPUT_GRAPH = "torch._dynamo.output_graph"

COMPILE_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


class Patches:
    """The attributes of torch replaced while recording."""

    def __init__(self) -> None:
        self._restore: list[Callable[[], None]] = []  # undoes what was patched, in reverse

    def patch(
        self, owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        """Replace ``owner.name`` (a torch class or module) while recording; undone at close."""
        original = owner.__dict__[name]
        setattr(owner, name, functools.wraps(original)(wrap(original)))
        self._restore.append(lambda: setattr(owner, name, original))

    def instrument_graphs(
        self,
        wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
        hooks: list[types.CodeType],
        *,
        untraced: Sequence[RemovableHandle] = (),
    ) -> None:
        """Wrap dynamo's hand-over of a captured graph to its backend with ``wrap``
        (:mod:`hooktrace.recorder.graphs.backend`), and have dynamo never compile the
        process-wide ``hooks`` as frames of their own, nor what they call. Traced inside a
        module's call, the hooks mark its outputs in the graph; called from a frame that
        dynamo runs eagerly (a module's own call, where dynamo compiles its forward alone),
        they must run eagerly too and record as they do without a compiler: compiled, the
        forward hook would make a graph of its marks alone, and the recorder's own
        functions would be compiled. The hooks registered by the ``untraced`` handles (the
        optimizer's step hooks, which a compiled ``opt.step`` would trace: AdamW's step
        made 14 graphs of them) are disabled for dynamo: it runs them as they are. Dynamo
        takes seconds to import (and imports ``torch.distributed.tensor``): where the script
        has not imported it yet, ``torch.compile`` is wrapped instead, to do this at its
        first call (``nn.Module.compile`` calls it too)."""
        if _OUTPUT_GRAPH in sys.modules:
            self._wrap_output_graph(wrap, hooks, untraced)
            return
        wrapped = [False]

        def wrap_compile(original: Callable[..., Any]) -> Callable[..., Any]:
            def compile(*args: Any, **kwargs: Any) -> Any:
                if not wrapped[0] and self._restore:
                    wrapped[0] = True
                    self._wrap_output_graph(wrap, hooks, untraced)
                return original(*args, **kwargs)

            return compile

        self.patch(torch, "compile", wrap_compile)

    def _wrap_output_graph(
        self,
        wrap: Callable[[Callable[..., Any]], Callable[..., Any]],
        hooks: list[types.CodeType],
        untraced: Sequence[RemovableHandle],
    ) -> None:
        from torch._dynamo import disable
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.output_graph import OutputGraph
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        eager = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        for code in hooks:  # (hooktrace's own code: left so after the recording)
            set_code_exec_strategy(code, eager)
        for handle in untraced:  # (their handles remove them as they are now)
            registered = handle.hooks_dict_ref()
            if registered is not None and handle.id in registered:
                registered[handle.id] = disable(registered[handle.id])
        self.patch(OutputGraph, "call_user_compiler", wrap)

    def hide_hooks_from_compile(self, ours: Collection[int]) -> None:
        """torch.compile's wrapper (``OptimizedModule``) warns at every call where a
        process-wide module hook exists, and the recorder's are not the script's. While
        recording, torch's question (``_has_any_global_hook``; in torch 2.13 the wrapper is
        the only one to ask it) is answered False where the hooks whose handle ids are
        ``ours`` are the only ones, as an unrecorded run answers it; otherwise as torch (or
        whatever replaced its function before) answers it, so the script's own hooks make it
        warn as before. A filter on the warning came behind any filter the script set once
        the recording ran (``warnings.simplefilter("always")``, a test suite's ``"error"``):
        the script saw the warning at every call, or had it raised. The filter stays only
        for a torch without that function, should one warn."""
        from torch.nn.modules import module as torch_module

        if "_has_any_global_hook" not in torch_module.__dict__:
            self.ignore_warning(COMPILE_HOOKS_WARNING)
            return
        ours = frozenset(ours)
        names = (
            "_global_backward_pre_hooks",
            "_global_backward_hooks",
            "_global_forward_pre_hooks",
            "_global_forward_hooks",
            "_global_forward_hooks_always_called",
            "_global_forward_hooks_with_kwargs",
        )

        def wrap(original: Callable[[], Any]) -> Callable[[], Any]:
            def has_any_global_hook() -> Any:
                # (a plain loop: dynamo, where it meets this, traces no generator)
                for name in names:
                    hooks = getattr(torch_module, name, None)
                    if not isinstance(hooks, dict) or not ours.issuperset(hooks):
                        return original()  # another torch's names, or hooks of the script's
                return False

            return has_any_global_hook

        self.patch(torch_module, "_has_any_global_hook", wrap)

    def ignore_warning(self, message: str) -> None:
        """Filter a warning of torch's about the process-wide hooks while recording."""
        warnings.filterwarnings("ignore", message=message)
        added = warnings.filters[0]

        def remove() -> None:
            filters: list[Any] = warnings.filters  # type: ignore[assignment]
            if added in filters:
                filters.remove(added)
                warnings._filters_mutated()  # type: ignore[attr-defined]

        self._restore.append(remove)

    def undo(self) -> None:
        """Put back every attribute patched."""
        while self._restore:
            self._restore.pop()()


def replicas_recorded(
    table: ModuleTable,
) -> Callable[[Callable[..., nn.Module]], Callable[..., nn.Module]]:
    """The wrap of ``nn.Module._replicate_for_data_parallel``: nn.DataParallel on several
    devices calls copies made each forward, never the module itself, so each copy is
    entered in ``table`` as the module it copies."""

    def wrap(original: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        def _replicate_for_data_parallel(module: nn.Module) -> nn.Module:
            replica = original(module)
            table.replica(replica, module)
            return replica

        return _replicate_for_data_parallel

    return wrap
