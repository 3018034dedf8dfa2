"""Recording a script nobody edited: roots found as they run, steps found without help.

A *root* is a module called outside any other module's forward: the model, a loss module, a
second model. Global module hooks notice each new root at its first call and hand it to the
recorder, which hooks its modules as :func:`hooktrace.record` would. Wrappers are looked
through (DistributedDataParallel, DataParallel, torch.compile's OptimizedModule), so their
``module.`` and ``_orig_mod.`` prefixes never appear in names.

Steps, where the script says nothing:
- an optimizer step ends a step (as with :func:`hooktrace.record`);
- a GradScaler that skips the optimizer step, or ``zero_grad()`` after a backward pass with
  no optimizer step in between, ends a step marked skipped;
- with no optimizer on the model, each completed backward pass is a step;
- with neither optimizer nor backward pass (inference), each root forward is a step.
"""

from __future__ import annotations

import os
import sys
import types
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from hooktrace.recorder.hooks import attach
from hooktrace.recorder.hooks.attach import Attached
from hooktrace.recorder.hooks.names import unwrap, user_class
from hooktrace.recorder.recording.recorder import Recorder


class ScriptRecorder(Recorder):
    """A recorder with no models given: it finds them, and their steps, as the script runs."""

    finds_models = True  # models a compiled function calls, found as it compiles

    _unrecorded_hint = (
        " (hooktrace record finds a model at its first call, or as dynamo compiles a function "
        "that calls it; hooktrace.record(model, out) in the script records any other)"
    )

    def __init__(self, out: str, **options: Any) -> None:
        self._depth = 0
        self._primary: str | None = None
        # id -> a weak reference: a WeakSet would hash the optimizer, which a subclass with
        # __eq__ and no __hash__ (a dataclass's) refuses
        self._optimizers: dict[int, weakref.ref[torch.optim.Optimizer]] = {}
        self._stepped_in_call = False
        self._in_optimizer_step = False  # LBFGS calls zero_grad() inside step()
        self._saw_backward = False
        self._model_forwards = 0  # top-level forwards of models with parameters in this step
        self._model_ids: set[int] = set()  # roots with parameters, and their wrappers
        self._graphs: dict[int, weakref.ref[nn.Module]] = {}  # a backend's, run as modules
        self._wrapper_ids: set[int] = set()
        super().__init__(None, out, **options)
        self._compiled.finder = self._found_in_a_graph

    # -- installing ------------------------------------------------------------------------

    def _install(self) -> None:
        super()._install()
        self._patches.patch(torch.optim.Optimizer, "__init__", self._wrap_optimizer_init)
        # an optimizer unpickled or deep-copied is made by __setstate__, not __init__
        self._patches.patch(torch.optim.Optimizer, "__setstate__", self._wrap_optimizer_init)
        self._patches.patch(torch.optim.Optimizer, "zero_grad", self._wrap_zero_grad)
        self._patches.patch(torch.amp.GradScaler, "step", self._wrap_scaler_step)

    # -- finding roots ---------------------------------------------------------------------
    #
    # The process-wide hooks count the depth of every module call: a module called at depth
    # one (outside any other module's forward) that nobody has named yet is a new root.

    def _pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None
    ) -> None:
        if attach.is_compiling():  # dynamo traces this: the arguments are marked in its graph
            super()._pre(module, args, kwargs)
            return
        if attach.in_backward() or self._paused or attach.traced():
            return
        self._depth += 1
        if self._depth == 1 and self._active:
            try:
                if (
                    id(module) not in self._names.known
                    and id(module) not in self._wrapper_ids
                    and not self._a_compilers_graph(module)
                ):
                    with self._lock:
                        self._discover_root(module)
                if id(module) in self._model_ids:
                    self._model_forward()
            except Exception as exc:
                self._fault(exc, f"finding the model {type(module).__name__}")
        super()._pre(module, args, kwargs)

    def _model_forward(self) -> None:
        """A model's forward begins, outside any module's: in inference (no backward pass,
        no optimizer), each is a step, ended when the next one starts (a backward pass may
        still follow)."""
        if self._model_forwards and self._inference_mode():
            self._end_step()
        self._model_forwards += 1

    def _enter_root(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._depth == 0 and id(module) in self._model_ids:  # no call of it outside: a
            self._model_forward()  # compiled function's graph runs it (_on_graph)
        super()._enter_root(module, args)

    def _exit(
        self, entry: Attached | None, module: nn.Module, args: tuple[Any, ...], output: Any
    ) -> None:
        if attach.in_backward() or self._paused or attach.traced():  # (_post: not compiling)
            return
        super()._exit(entry, module, args, output)
        self._depth = max(0, self._depth - 1)

    def graph_calls(self, modules: Sequence[Any]) -> None:
        """Models a graph calls, found as dynamo compiles it: those called only inside a
        compiled function are met nowhere else. Taken as roots in the order the graph
        calls them, as their first calls would take them."""
        if not self._active or self._paused:
            return
        with self._lock:
            for module in modules:
                try:
                    if id(module) not in self._names.known and id(module) not in self._wrapper_ids:
                        self._discover_root(module)
                except Exception as exc:
                    self._fault(exc, f"finding the model {type(module).__name__}")

    def _found_in_a_graph(self, module: nn.Module) -> bool:
        """A module a compiled graph runs for, met nowhere else (a second model of the first
        one's class, passed to the compiled function that was compiled for the first):
        taken as a root, as its first call would take it. Whether it was."""
        if not self._active or self._paused or id(module) in self._names.known:
            return False
        try:
            self._discover_root(module)
        except Exception as exc:
            self._fault(exc, f"finding the model {type(module).__name__}")
            return False
        return id(unwrap(module)[0]) in self._names.known

    def _a_compilers_graph(self, module: nn.Module) -> bool:
        """Whether ``module`` is a graph that a compiled function's backend runs as a module
        (aot_eager's forward graph): no model of the script's. Told by who calls it, past
        torch's module and fx frames: a backend, or AOTAutograd's runtime (not a user's
        ``torch.fx`` model called through ``torch.func``). Remembered, while it lives."""
        graphs = self._graphs
        known = graphs.get(id(module))
        if known is not None and known() is module:
            return True
        if not isinstance(module, torch.fx.GraphModule):
            return False
        frame: types.FrameType | None = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename.startswith(_CALLING_PACKAGES):
            frame = frame.f_back
        if frame is None or not frame.f_code.co_filename.startswith(_COMPILER_RUNTIME):
            return False
        key = id(module)
        graphs[key] = weakref.ref(module, lambda _: graphs.pop(key, None))
        return True

    def _discover_root(self, module: nn.Module) -> None:
        inner, _ = unwrap(module)
        names = self._names
        if id(inner) in names.known:
            return
        before = {(e.module, e.slot) for e in (*names.param_entries, *names.buffer_entries)}
        hooked = self._discover(module, inner)
        if any(True for _ in inner.parameters()):
            self._model_ids.update({id(module), id(hooked)})
        if hooked is not module:
            self._wrapper_ids.add(id(module))
        self._params_of_a_late_root(before)

    def _params_of_a_late_root(self, before: set[tuple[str, str]]) -> None:
        """A root found after the step's first forward recorded the parameters (a student
        met after its teacher): its own, in that forward's phase, as a run that knew the
        root from its start records them (a later step; a compiled function's graph, which
        finds every root it calls before it runs). Parameters as that forward found them
        (no optimizer has stepped them since); buffers as they are now."""
        phase = self._params_phase
        if not (self._recording and self.params) or phase is None:
            return
        names = self._names
        for kind, entries in (("param", names.param_entries), ("buffer", names.buffer_entries)):
            late = [e for e in entries if (e.module, e.slot) not in before]
            if late:
                self._record_params(kind, late, phase)

    def _end_step(self, *, skipped: bool = False) -> None:
        super()._end_step(skipped=skipped)
        self._model_forwards = 0

    def _outside_forwards(self) -> None:
        super()._outside_forwards()
        self._depth = 0

    def _discover(self, module: nn.Module, inner: nn.Module) -> nn.Module:
        """A new root: the first with parameters is the model, named as in named_modules();
        the others (a loss module, a second model) are prefixed by their class name."""
        base = user_class(inner).__name__
        name, n = base, 1
        while name in self.roots:
            name, n = f"{base}#{n}", n + 1
        primary = self._primary is None and any(True for _ in inner.parameters())
        if primary:
            self._primary = name
        return self._add_root(name, module, prefixed=not primary)

    # -- steps -----------------------------------------------------------------------------

    def _owns_an_optimizer(self) -> bool:
        alive = [ref() for ref in list(self._optimizers.values())]
        return any(self._optimizer_holds_ours(opt) for opt in alive if opt is not None)

    def _optimizer_holds_ours(self, optimizer: torch.optim.Optimizer) -> bool:
        return any(
            id(p) in self._names.param_ids
            for group in optimizer.param_groups
            for p in group["params"]
        )

    def _inference_mode(self) -> bool:
        return not self._saw_backward and not self._owns_an_optimizer()

    def _optimizer_stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._in_optimizer_step = True
        self._keep_optimizer(optimizer)  # however it was made
        super()._optimizer_stepping(optimizer, args, kwargs)

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._in_optimizer_step = False
        self._stepped_in_call = True
        super()._optimizer_stepped(optimizer, args, kwargs)

    def _backward_done(self) -> None:
        super()._backward_done()
        self._saw_backward = True
        if not self._owns_an_optimizer():
            self._end_step()

    def _keep_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        key, optimizers = id(optimizer), self._optimizers
        if key not in optimizers or optimizers[key]() is not optimizer:
            optimizers[key] = weakref.ref(optimizer, lambda _: optimizers.pop(key, None))

    def _wrap_optimizer_init(self, original: Callable[..., None]) -> Callable[..., None]:
        def __init__(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            original(optimizer, *args, **kwargs)
            self._keep_optimizer(optimizer)

        return __init__

    def _wrap_zero_grad(self, original: Callable[..., None]) -> Callable[..., None]:
        def zero_grad(optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> None:
            # gradients thrown away after a backward pass, with no step taken: a skipped step
            if (
                self._active
                and self.micro_step > 0
                and not self._in_optimizer_step
                and self._optimizer_holds_ours(optimizer)
            ):
                self._end_step(skipped=True)
            original(optimizer, *args, **kwargs)

        return zero_grad

    def _wrap_scaler_step(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def step(scaler: Any, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            self._stepped_in_call = False
            result = original(scaler, optimizer, *args, **kwargs)
            if not self._stepped_in_call and self._active and self._optimizer_holds_ours(optimizer):
                self._end_step(skipped=True)  # inf or NaN found: the scaler skipped the step
            return result

        return step


_TORCH = os.path.dirname(torch.__file__)
_COMPILER_RUNTIME = tuple(
    os.path.join(_TORCH, *package) + os.sep
    for package in (("_dynamo", "backends"), ("_functorch", "_aot_autograd"), ("_inductor",))
)
"""Where a backend runs a graph it compiled as a module (aot_eager: the first)."""
_HOOKTRACE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CALLING_PACKAGES = (
    os.path.join(_TORCH, "nn") + os.sep,
    os.path.join(_TORCH, "fx") + os.sep,
    _HOOKTRACE + os.sep,
)
"""Between a module's caller and a forward pre-hook: torch's module and fx calls, and
hooktrace's own."""
