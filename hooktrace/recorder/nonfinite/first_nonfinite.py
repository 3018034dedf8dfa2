"""Run a captured call again and name the first aten operation that made a NaN or Inf.

:func:`run_forward` and :func:`run_backward` run a module (a copy: the caller's is never
touched) eagerly, torch.compile set aside (:func:`eagerly`), under :class:`_Watch`, a
dispatch mode that checks the outputs of every aten operation. The first operation whose
outputs hold a NaN none of its inputs held, or an Inf where every input was finite, is the
one named: its aten name (``aten::log``, ``aten::div.Tensor``), the statistics of its
inputs (the zeros, negatives or huge values that explain it), and the line of the model's
code that called it. In the forward that line is the innermost frame of the Python stack
outside torch and hooktrace; in the backward, the same frame of the stack that autograd's
anomaly mode kept when the forward made the node.
"""

from __future__ import annotations

import contextlib
import math
import re
import traceback
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from hooktrace.package import FOLDER
from hooktrace.recorder.records.flatten import flatten

_TORCH_DIR = str(Path(torch.__file__).resolve().parent)
_HOOKTRACE_DIR = str(FOLDER.resolve())  # every room's frames, not only the recorder's
_FRAME = re.compile(
    r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<function>[^\n]+)\n(?P<code>[^\n]*)'
)


@dataclass
class Finding:
    """What a re-run found: ``status`` is ``found`` (the operation is named), ``not
    reproduced`` (the re-run made no non-finite value) or ``failed`` (it raised)."""

    status: str
    reproduces: bool = False
    op: str | None = None
    node: str | None = None  # the autograd node running the op, in a backward
    file: str | None = None
    line: int | None = None
    function: str | None = None
    code: str | None = None
    op_inputs: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""
    operations: int = 0  # aten operations run before the first non-finite one, and it

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_forward(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Finding:
    """Call ``module(*args, **kwargs)`` under the watch, with grad mode and autocast as they
    are, and the RNG of every device forked (the caller's RNG is left as it was)."""
    watch = _Watch()
    try:
        with eagerly(), _forked_rng(args, kwargs), own_saved_tensors(), watch:
            output = module(*args, **kwargs)
    except Exception as exc:
        return Finding("failed", message=f"the forward raised {type(exc).__name__}: {exc}")
    reproduces = _has_nonfinite(tensor for _, tensor in flatten(output))
    return watch.finding(reproduces, "the output")


def run_backward(
    module: nn.Module,
    args: tuple[Any, ...],
    kwargs: Mapping[str, Any],
    grad_outputs: Mapping[str, torch.Tensor],
) -> Finding:
    """Run the forward again with grad on and anomaly mode keeping each node's stack, then the
    backward from ``grad_outputs`` (by output slot) under the watch. It reproduces when a
    gradient of an input or a parameter comes out non-finite."""
    watch = _Watch()
    try:
        with eagerly(), _forked_rng(args, kwargs), own_saved_tensors():
            with torch.enable_grad(), torch.autograd.set_detect_anomaly(True, check_nan=False):
                output = module(*args, **kwargs)
            pairs = [
                (tensor, grad_outputs[slot])
                for slot, tensor in flatten(output)
                if slot in grad_outputs and tensor.requires_grad
            ]
            if not pairs:
                return Finding("failed", message="no output of the re-run requires a gradient")
            with watch:
                torch.autograd.backward([t for t, _ in pairs], [g for _, g in pairs])
    except Exception as exc:
        return Finding("failed", message=f"the backward raised {type(exc).__name__}: {exc}")
    leaves = [t for _, t in _tensors(args, kwargs)] + list(module.parameters())
    reproduces = _has_nonfinite(t.grad for t in leaves if t.grad is not None)
    return watch.finding(reproduces, "a gradient of an input or a parameter")


def for_replay(tensor: torch.Tensor, *, grad: bool) -> torch.Tensor:
    """A copy of a captured input to run on: a floating one requires grad for a backward."""
    copy = tensor.detach().clone()
    if grad and (copy.is_floating_point() or copy.is_complex()):
        copy.requires_grad_(True)
    return copy


class _Watch(TorchDispatchMode):
    """Checks every aten operation's outputs; keeps the first that made a non-finite value."""

    def __init__(self) -> None:
        super().__init__()
        self.found: Finding | None = None
        self.operations = 0

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if self.found is not None or func._schema.name in _UNINITIALISED:
            return func(*args, **kwargs)
        self.operations += 1
        inputs = _read(func, args, kwargs)
        had_nan, had_inf = nonfinite_flags(inputs)
        mutates = func._schema.is_mutable
        before = [describe(t) for t in inputs] if mutates else None
        output = func(*args, **kwargs)
        nan, inf = nonfinite_flags(t for t in tree_leaves(output) if isinstance(t, torch.Tensor))
        if (nan and not had_nan) or (inf and not (had_nan or had_inf)):
            self.found = self._finding(func, before or [describe(t) for t in inputs])
        return output

    def _finding(self, func: Any, op_inputs: list[dict[str, Any]]) -> Finding:
        node = torch._C._current_autograd_node()
        frame: tuple[str, int, str, str] | None
        if node is not None:
            metadata: dict[str, Any] = node.metadata  # type: ignore[assignment]
            frame = _user_frame_of(metadata.get("traceback_") or [])
        else:
            frame = _user_frame(traceback.extract_stack())
        file, line, function, code = frame if frame is not None else (None, None, None, None)
        return Finding(
            "found",
            op=op_name(func),
            node=node.name() if node is not None else None,
            file=file,
            line=line,
            function=function,
            code=code,
            op_inputs=op_inputs,
            operations=self.operations,
        )

    def finding(self, reproduces: bool, what: str) -> Finding:
        if self.found is not None:
            self.found.reproduces = reproduces
            return self.found
        if reproduces:
            message = (
                f"{what} came out non-finite, but no aten operation made a new NaN or Inf "
                f"(in {self.operations} operations)"
            )
            return Finding("failed", reproduces=True, message=message, operations=self.operations)
        message = (
            f"run again on the captured tensors, {what} stayed finite: the non-finite value "
            "depends on something the capture does not hold (the RNG at the call, a buffer "
            "changed earlier, another thread)"
        )
        return Finding("not reproduced", message=message, operations=self.operations)


def _read(func: Any, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[torch.Tensor]:
    """The tensors an operation reads: its arguments, but for the ``out=`` buffers it only
    writes (whose old values, often uninitialised memory, are no input of it)."""
    written = {a.name for a in func._schema.arguments if a.is_out}
    if written:  # (out= arguments are keyword-only: in kwargs here)
        kwargs = {name: value for name, value in kwargs.items() if name not in written}
    return [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]


_UNINITIALISED = frozenset(
    {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
     "aten::new_empty_strided", "aten::empty_permuted", "aten::resize_", "aten::set_"}
)  # fmt: skip
"""Operations whose output holds whatever the memory held: a NaN there is no finding."""


def op_name(func: Any) -> str:
    """``aten::log``, ``aten::div.Tensor``: the schema name, with the overload unless default."""
    overload = func._overloadname
    name = func._schema.name
    return name if overload in ("default", "") else f"{name}.{overload}"


def describe(tensor: torch.Tensor) -> dict[str, Any]:
    """The statistics that explain a non-finite result: range, zeros, negatives, the smallest
    magnitude that is not zero, NaN and Inf counts."""
    info: dict[str, Any] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype)[6:]}
    if tensor.device.type == "meta" or tensor.numel() == 0:
        return info
    tensor = tensor.detach()
    if tensor.is_complex():
        tensor = tensor.abs()
    if not (tensor.is_floating_point() or tensor.dtype == torch.bool or _integer(tensor)):
        return info
    x = tensor.detach().to(torch.float64).flatten()
    finite = x[torch.isfinite(x)]
    magnitudes = finite.abs()
    nonzero = magnitudes[magnitudes > 0]
    info.update(
        numel=x.numel(),
        min=_number(finite.min()) if finite.numel() else None,
        max=_number(finite.max()) if finite.numel() else None,
        smallest_nonzero=_number(nonzero.min()) if nonzero.numel() else None,
        zeros=int((x == 0).sum()),
        negatives=int((x < 0).sum()),
        nan=int(torch.isnan(x).sum()),
        inf=int(torch.isinf(x).sum()),
    )
    return info


def _integer(tensor: torch.Tensor) -> bool:
    return not tensor.is_floating_point() and not tensor.is_complex() and tensor.dtype != torch.bool


def _number(value: torch.Tensor) -> float:
    number = float(value)
    return number if math.isfinite(number) else float("nan")


def nonfinite_flags(tensors: Iterable[torch.Tensor]) -> tuple[bool, bool]:
    """(holds a NaN, holds an Inf) over the floating tensors among ``tensors``."""
    nan = inf = False
    for t in tensors:
        if t.device.type == "meta" or not (t.is_floating_point() or t.is_complex()):
            continue
        t = t.detach()
        nan = nan or bool(torch.isnan(t).any())
        inf = inf or bool(torch.isinf(t).any())
    return nan, inf


def _has_nonfinite(tensors: Iterable[torch.Tensor]) -> bool:
    nan, inf = nonfinite_flags(tensors)
    return nan or inf


def _tensors(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> list[tuple[int, torch.Tensor]]:
    leaves = tree_leaves((args, dict(kwargs)))
    return [(i, t) for i, t in enumerate(leaves) if isinstance(t, torch.Tensor)]


def _ours(filename: str) -> bool:
    """A frame of torch or hooktrace, or Python's own (``<frozen ...>``, ``<string>``)."""
    return (
        filename.startswith((_TORCH_DIR, _HOOKTRACE_DIR, "<"))
        or "/torch/" in filename  # torch's files seen through another path
    )


def _user_frame(stack: traceback.StackSummary) -> tuple[str, int, str, str] | None:
    for frame in reversed(stack):
        if not _ours(str(Path(frame.filename).resolve())):
            code = (frame.line or "").strip()
            return _shown(frame.filename), int(frame.lineno or 0), frame.name, code
    return None


def _shown(filename: str) -> str:
    """A source file as a person would name it: relative to the working directory where it
    lies below it (the script and its modules), else as Python has it."""
    try:
        return str(Path(filename).resolve().relative_to(Path.cwd().resolve()))
    except (ValueError, OSError):
        return filename


def _user_frame_of(formatted: list[str]) -> tuple[str, int, str, str] | None:
    """The innermost frame outside torch and hooktrace of a stack that
    ``traceback.format_stack`` wrote (what anomaly mode keeps)."""
    for entry in reversed(formatted):
        match = _FRAME.search(entry)
        if match is None:
            continue
        file = match.group("file")
        if not _ours(str(Path(file).resolve())):
            code = match.group("code").strip()
            return _shown(file), int(match.group("line")), match.group("function").strip(), code
    return None


def eagerly() -> AbstractContextManager[Any]:
    """torch.compile set aside while a copy runs: a compiled module or function inside it
    runs as its Python code, and dynamo compiles nothing for the copy. Compiled, its fused
    kernels would hide the operations the watch names, a compiled backward would show only
    its extern kernels (``aten::mm.out``, with their uninitialised ``out=`` buffers), and
    the graphs compiled for the copy (without the module hooks, with the re-run's own)
    would go into the user's cache, where the user's model could run them next. (torch
    before 2.6 has no stance: there, only a model compiled whole runs eagerly, by
    :func:`~hooktrace.recorder.nonfinite.rerun.users_module`.)"""
    set_stance = getattr(torch.compiler, "set_stance", None)
    if set_stance is None:
        return contextlib.nullcontext()
    return set_stance("force_eager")


def own_saved_tensors() -> Any:
    """Saved-tensor hooks that keep tensors as they are, over whatever hooks the user's code
    set (a checkpoint's, which count what its forward saves: the re-run inside a recorded
    call must not add to them)."""
    return torch.autograd.graph.saved_tensors_hooks(_same, _same)


def _same(tensor: Any) -> Any:
    return tensor


def _forked_rng(args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> Any:
    """``torch.random.fork_rng`` over the devices the call's tensors live on."""
    devices = {t.device.index or 0 for _, t in _tensors(args, kwargs) if t.device.type == "cuda"}
    return torch.random.fork_rng(devices=sorted(devices))
