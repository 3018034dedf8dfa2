"""Running a user's model again, unseen: for a non-finite capture's re-runs.

- :func:`users_module`: the user's own module inside torch.compile's wrapper, which a model
  compiled whole is hooked and named by: the module a capture holds;
- :func:`replica`: a deep copy of a module, without the hooks a user hung on it;
- :func:`no_module_hooks`: the process-wide module hooks set aside while a copy runs;
- :class:`RootCall`: what ran one training forward of a root (its inputs, by reference, the
  RNG, grad mode, autocast), and :meth:`RootCall.rerun`, which runs that forward and its
  backward again on a replica and returns every module call of it (:class:`Call`): its
  inputs, outputs and the gradients at both.

The recorder holds a RootCall a training forward, nothing more; the activations and
gradients a backward capture needs are made again here, when one is needed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.modules.module as module_hooks
from torch import nn
from torch.utils._pytree import tree_map_only

from hooktrace.recorder.nonfinite.first_nonfinite import eagerly, own_saved_tensors
from hooktrace.recorder.records.flatten import flatten, flatten_call


@dataclass
class Call:
    """One module call of a re-run: what it took and gave, and the gradients at both (by
    slot; absent where no gradient reached)."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any = None
    grad_outputs: dict[str, torch.Tensor] = field(default_factory=dict)
    grad_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def inputs(self) -> list[tuple[str, torch.Tensor]]:
        return list(flatten_call(self.args, self.kwargs))

    def outputs(self) -> list[tuple[str, torch.Tensor]]:
        return list(flatten(self.output))


@dataclass
class RootCall:
    """A root's training forward, as much of it as runs it again: its inputs (references to
    the caller's tensors), the RNG of the CPU and of each GPU, grad mode, autocast, and the
    versions of the model's buffers (a buffer the forward changes, an EMA's, makes a re-run
    differ: ``buffers_changed`` names them)."""

    module: nn.Module
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any]
    cpu_rng: torch.Tensor
    cuda_rng: list[torch.Tensor]
    grad_enabled: bool
    autocast: list[tuple[str, torch.dtype]]
    buffer_versions: list[tuple[str, torch.Tensor, int]]

    @classmethod
    def now(
        cls,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: Mapping[str, Any],
        buffers: list[tuple[str, torch.Tensor]],
    ) -> RootCall:
        cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
        return cls(
            module=module,
            args=args,
            kwargs=kwargs,
            cpu_rng=torch.get_rng_state(),
            cuda_rng=torch.cuda.get_rng_state_all() if cuda else [],
            grad_enabled=torch.is_grad_enabled(),
            autocast=[
                (device, torch.get_autocast_dtype(device))
                for device in ("cpu", "cuda")
                if torch.is_autocast_enabled(device)
            ],
            buffer_versions=[(n, b, b._version) for n, b in buffers],
        )

    def buffers_changed(self) -> list[str]:
        return [name for name, b, version in self.buffer_versions if b._version != version]

    @contextmanager
    def modes(self) -> Iterator[None]:
        """Grad mode and autocast as the forward ran them."""
        with ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(self.grad_enabled))
            for device, dtype in self.autocast:
                stack.enter_context(torch.autocast(device, dtype=dtype))
            yield

    def rerun(self, grads: Mapping[str, torch.Tensor]) -> tuple[nn.Module, dict[str, list[Call]]]:
        """Run the forward again on a replica (the parameters are as it ran them until the
        optimizer steps), then its backward from ``grads``, the gradients the forward's
        outputs received (by slot). Returns the replica, its parameters' gradients those of
        this backward alone, and its module calls by qualified name, call after call: of a
        model compiled whole, the model's, run eagerly."""
        model = replica(users_module(self.module))
        for parameter in model.parameters():
            parameter.grad = None  # the copy's own: not what earlier backwards accumulated
        calls: dict[str, list[Call]] = {}

        def keep(into: dict[str, torch.Tensor], slot: str) -> Callable[[torch.Tensor], None]:
            def hook(grad: torch.Tensor) -> None:
                into[slot] = grad

            return hook

        def pre(qualname: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
                call = Call(args, kwargs)
                calls.setdefault(qualname, []).append(call)
                for slot, tensor in call.inputs():
                    if tensor.requires_grad:
                        tensor.register_hook(keep(call.grad_inputs, slot))

            return hook

        def post(qualname: str) -> Callable[..., None]:
            def hook(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
                call = calls[qualname][-1]
                call.output = output
                for slot, tensor in call.outputs():
                    if tensor.requires_grad:
                        tensor.register_hook(keep(call.grad_outputs, slot))

            return hook

        for qualname, sub in model.named_modules():
            sub.register_forward_pre_hook(pre(qualname), with_kwargs=True)
            sub.register_forward_hook(post(qualname), with_kwargs=True)
        args, kwargs = tree_map_only(
            torch.Tensor, lambda t: t.detach().clone(), (self.args, dict(self.kwargs))
        )
        with no_module_hooks(), eagerly(), ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=range(len(self.cuda_rng))))
            torch.set_rng_state(self.cpu_rng)
            if self.cuda_rng:
                torch.cuda.set_rng_state_all(self.cuda_rng)
            stack.enter_context(own_saved_tensors())
            with self.modes():
                output = model(*args, **kwargs)
            pairs = [(t, grads[slot]) for slot, t in flatten(output) if slot in grads]
            pairs = [(t, g) for t, g in pairs if t.requires_grad]
            if pairs:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
        return model, calls


def users_module(module: nn.Module) -> nn.Module:
    """The module torch.compile's wrapper (``OptimizedModule``) holds, the user's own, where
    ``module`` is one; else ``module``. The recorder names a model compiled whole by its
    wrapper; a capture holds the model (its class, its parameters and buffers named as
    ``model.named_parameters()`` names them, without ``_orig_mod.``), as replay takes it."""
    while type(module).__name__ == "OptimizedModule" and isinstance(
        getattr(module, "_orig_mod", None), nn.Module
    ):
        module = module._orig_mod  # type: ignore[assignment]
    return module


def replica(module: nn.Module) -> nn.Module:
    """A deep copy to run again: the user's module is never called twice. Hooks a user hung
    on the copied modules are left out (they would see a call the script never made; and
    what they are bound to is not copied), all but torch's own (weight_norm's computes the
    weight)."""
    memo: dict[int, Any] = {}
    for sub in module.modules():
        for hooks in _hook_tables(sub):
            for hook in hooks.values():
                memo[id(hook)] = hook  # shared, not copied: removed from the copy below
    copied = copy.deepcopy(module, memo)
    for sub in copied.modules():
        for hooks in _hook_tables(sub):
            for key in [k for k, hook in hooks.items() if not _torch_own(hook)]:
                del hooks[key]
    return copied


def _hook_tables(module: nn.Module) -> tuple[dict[int, Any], ...]:
    return (module._forward_pre_hooks, module._forward_hooks, module._backward_hooks,
            module._backward_pre_hooks)  # fmt: skip


def _torch_own(hook: Any) -> bool:
    owner = getattr(hook, "__module__", None) or type(hook).__module__
    return owner.startswith("torch.")


_GLOBAL_HOOKS = (
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs", "_global_backward_pre_hooks", "_global_backward_hooks",
)  # fmt: skip


@contextmanager
def no_module_hooks() -> Iterator[None]:
    """The process-wide module hooks set aside while a copy runs: the user's would see a
    call the script never made (hooktrace's own ignore the copy anyway). They are shared by
    every thread: a module another thread calls meanwhile runs without them (docs: README,
    limits)."""
    saved = [(name, dict(getattr(module_hooks, name))) for name in _GLOBAL_HOOKS]
    for name, _ in saved:
        getattr(module_hooks, name).clear()
    try:
        yield
    finally:
        for name, hooks in saved:
            table = getattr(module_hooks, name)
            added = dict(table)  # registered meanwhile (by another thread): kept, after
            table.clear()
            table.update(hooks)
            table.update(added)
