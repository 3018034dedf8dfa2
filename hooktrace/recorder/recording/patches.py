"""What the recorder changes in torch while it records, and puts back when it ends.

The process-wide hooks (:mod:`hooktrace.recorder.hooks.attach`) see every module call, but three
kinds of call go around them: a module compiled in place (``nn.Module.compile()``) calls its
compiled function instead of its hooks; ``nn.DataParallel`` calls per-device copies of the
module, made each forward; and ``torch.jit.trace`` runs the model again to check its graph,
which is no call of the run. The recorder patches those three places, and filters a warning
that torch prints because process-wide hooks exist. Apart from the hooks because each of
these is a change to torch itself, undone in one place (:meth:`Patches.undo`) however the
recording ends.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from hooktrace.recorder.hooks.attach import ModuleTable, is_compiling
from hooktrace.recorder.hooks.hooks import Hooks

_OUTPUT_GRAPH = "torch._dynamo.output_graph"

COMPILE_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


class Patches:
    """The attributes of torch replaced while recording, and the compiled calls wrapped."""

    def __init__(self) -> None:
        self._restore: list[Callable[[], None]] = []  # undoes what was patched, in reverse
        self._compiled_calls: list[CompiledCall] = []

    def patch(
        self, owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        """Replace ``owner.name`` (a torch class or module) while recording; undone at close."""
        original = owner.__dict__[name]
        setattr(owner, name, functools.wraps(original)(wrap(original)))
        self._restore.append(lambda: setattr(owner, name, original))

    def instrument_graphs(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Wrap dynamo's hand-over of a captured graph to its backend with ``wrap``
        (:mod:`hooktrace.recorder.graphs.backend`). Dynamo takes seconds to import: where the
        script has not imported it yet, ``torch.compile`` is wrapped instead, to wrap the
        hand-over at its first call (``nn.Module.compile`` calls it too)."""
        if _OUTPUT_GRAPH in sys.modules:
            self._wrap_output_graph(wrap)
            return
        wrapped = [False]

        def wrap_compile(original: Callable[..., Any]) -> Callable[..., Any]:
            def compile(*args: Any, **kwargs: Any) -> Any:
                if not wrapped[0] and self._restore:
                    wrapped[0] = True
                    self._wrap_output_graph(wrap)
                return original(*args, **kwargs)

            return compile

        self.patch(torch, "compile", wrap_compile)

    def _wrap_output_graph(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        from torch._dynamo.output_graph import OutputGraph

        self.patch(OutputGraph, "call_user_compiler", wrap)

    def ignore_warning(self, message: str) -> None:
        """torch warns about the process-wide hooks in the script's output: not the script's
        concern (its behaviour does not change), so the warning is filtered while recording."""
        warnings.filterwarnings("ignore", message=message)
        added = warnings.filters[0]

        def remove() -> None:
            filters: list[Any] = warnings.filters  # type: ignore[assignment]
            if added in filters:
                filters.remove(added)
                warnings._filters_mutated()  # type: ignore[attr-defined]

        self._restore.append(remove)

    def watch_compiled(self, module: nn.Module, recorder: Hooks) -> None:
        """nn.Module.compile() makes the module's calls skip every hook outside the compiled
        frame: its compiled call is wrapped in one that calls the hooks around it."""
        compiled = module.__dict__.get("_compiled_call_impl")
        if compiled is not None and not isinstance(compiled, CompiledCall):
            self._compiled_calls.append(CompiledCall(recorder, module, compiled))

    def undo(self) -> None:
        """Put back every compiled call wrapped and every attribute patched."""
        for compiled_call in self._compiled_calls:
            compiled_call.restore()
        self._compiled_calls.clear()
        while self._restore:
            self._restore.pop()()


class CompiledCall:
    """Stands in for the compiled call of a module compiled in place (nn.Module.compile):
    torch calls it instead of the module's hooks, so it calls the recorder's around the
    compiled function. It sits in the module's ``_compiled_call_impl``, which
    ``nn.Module.__getstate__`` leaves out: pickling, ``torch.save`` and copies never see it.
    The recorder puts the compiled function back when it closes."""

    def __init__(self, recorder: Hooks, module: nn.Module, compiled: Callable[..., Any]):
        self._recorder = recorder
        self._module = weakref.ref(module)
        self.compiled = compiled
        module.__dict__["_compiled_call_impl"] = self

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module = self._module()
        if module is None or is_compiling():
            return self.compiled(*args, **kwargs)
        recorder = self._recorder
        recorder._pre(module, args, kwargs)
        try:
            output = self.compiled(*args, **kwargs)
        except BaseException:
            recorder._exit(module, args, None)
            raise
        recorder._post(module, args, kwargs, output)
        recorder._exit(module, args, output)
        return output

    def restore(self) -> None:
        module = self._module()
        if module is not None and module.__dict__.get("_compiled_call_impl") is self:
            module.__dict__["_compiled_call_impl"] = self.compiled


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
