"""The recorder: hooks on modules, tensors and optimizers, and the step they belong to.

Hooks only observe: they queue statistics on the tensor's device and append to lists. At each
step boundary the step's observations go to the background writer. A fault inside hooktrace
warns once and stops recording (``strict=True`` raises instead); the trace written so far is
kept. Every hook is removed when the recorder closes, normally or by an exception.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import platform
import sys
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from hooktrace.errors import ConfigError, RecordingError
from hooktrace.recorder import attach, capture, finite
from hooktrace.recorder.attach import in_backward as _in_backward
from hooktrace.recorder.attach import in_transform as _in_transform
from hooktrace.recorder.attach import is_compiling
from hooktrace.recorder.flatten import describe_call, flatten, flatten_call
from hooktrace.recorder.histogram import histogram as histogram_of
from hooktrace.recorder.histogram import histogram_many
from hooktrace.recorder.params import Entry, RecordsCache, values_of
from hooktrace.recorder.pending import (
    Layouts,
    Meta,
    PendingStep,
    Staged,
    StagedUnits,
    Staging,
    StagingPool,
    compiled_kernels,
)
from hooktrace.recorder.select import (
    ModuleFilter,
    StepSelection,
    StepSpec,
    histogram_kinds,
    module_matcher,
)
from hooktrace.recorder.stats import (
    nested_values,
    plain,
    python_subclass,
    route,
    route_taken,
    shape_of,
    stageable,
    summarize_with_activity,
    unit_dim,
    unsupported,
    usual,
)
from hooktrace.trace import schema
from hooktrace.trace.captures import CAPTURES_DIR
from hooktrace.trace.histograms import HISTOGRAMS_DIR
from hooktrace.trace.histograms import WIDTH as HISTOGRAM_WIDTH
from hooktrace.trace.writer import TraceWriter

Models = nn.Module | Mapping[str, nn.Module] | Iterable[nn.Module]

# Module types whose 3-D outputs are (N, C, L): their units are channels, not the last dim.
_CHANNELS_FIRST = (
    nn.modules.conv._ConvNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.modules.pooling._MaxPoolNd,
    nn.modules.pooling._AvgPoolNd,
    nn.modules.pooling._AdaptiveAvgPoolNd,
    nn.modules.pooling._AdaptiveMaxPoolNd,
    nn.GroupNorm,
)

_RECENT = 4
"""Tensors whose statistics a hook remembers, the latest ones: a container's output is its
last child's, and one gradient may reach several hooks in a row."""

DEFAULT_HISTOGRAMS = ("param", "grad_param")
"""The record kinds histogrammed unless told otherwise (docs/FORMAT.md, "histograms")."""

_PRUNE_AT = 1024
"""Gradient hook handles held before the dead ones are dropped, at least."""

_ACTIVE: Recorder | None = None

_COMPILE_HOOKS_WARNING = r"Using `torch.compile\(module\)` when there are global hooks"


def active_recorder() -> Recorder | None:
    return _ACTIVE


def _leave_in_child() -> None:
    """A process forked while recording (a DataLoader worker, a multiprocessing pool) holds
    a copy of the recorder without its writer thread: it records nothing, and may start a
    recording of its own."""
    global _ACTIVE
    if _ACTIVE is not None:
        _ACTIVE._orphan()
        _ACTIVE = None


os.register_at_fork(after_in_child=_leave_in_child)


class Recorder:
    """Records the named modules of one or more models into a run directory.

    Use :func:`hooktrace.record` to make one. Steps advance on each optimizer step (any
    ``torch.optim`` optimizer holding a recorded parameter) and on :meth:`step`.
    """

    out: Path
    # per-step state, set by _reset_step_state()
    _recording: bool
    _full_step: bool
    _pending: PendingStep
    _calls: dict[tuple[str, str], int]
    _recompute_calls: dict[str, int]
    _grad_hooked: set[tuple[str, int]]
    # by id(tensor): the tensor, its version, its gradient hook's id, what that records
    _hooked: dict[int, tuple[weakref.ref[torch.Tensor], int, int, list[tuple[str, int, str, str]]]]
    _channel_shapes: set[torch.Size]
    _recent: OrderedDict[int, tuple[weakref.ref[torch.Tensor], int, Any, Any]]  # by id(tensor)
    _params_phase: str | None  # the phase whose forward recorded the step's parameters
    _output_specs: dict[tuple[str, int], str]  # call specs of calls with no tensor input
    _grads_recorded: bool  # the gradients' records made before the optimizer's update

    def __init__(
        self,
        models: Models | None,
        out: str | os.PathLike[str],
        *,
        modules: ModuleFilter = None,
        exclude: ModuleFilter = None,
        every: int = 1,
        steps: StepSpec = None,
        inputs: bool = False,
        params: bool = True,
        full_every: int | None = None,
        full_steps: StepSpec = None,
        full_modules: ModuleFilter = None,
        max_tensor_mb: float = 256.0,
        max_units: int = 65536,
        compression: str | None = None,
        buffer_mb: float = 256.0,
        strict: bool = False,
        overwrite: bool = False,
        capture_nonfinite: bool = True,
        capture_limit: int = capture.DEFAULT_LIMIT,
        capture_max_mb: float = capture.DEFAULT_MAX_MB,
        histograms: Collection[str] | None = DEFAULT_HISTOGRAMS,
        histogram_every: int = 1,
        command: list[str] | None = None,
    ) -> None:
        global _ACTIVE
        if _ACTIVE is not None:
            raise RecordingError(
                f"a recording into {_ACTIVE.out} is already active: close it before starting another"
            )
        self.out = Path(out)
        self.strict = strict
        self.inputs = inputs
        self.params = params
        self.max_tensor_bytes = int(max_tensor_mb * (1 << 20))
        self.max_units = max_units
        self._steps = StepSelection(steps, every=every)
        self._histogram_kinds = histogram_kinds(histograms)
        if histogram_every < 1:
            raise ConfigError(f"histogram_every must be 1 or more (got {histogram_every})")
        self._histogram_every = histogram_every
        full_wanted = full_every is not None or full_steps is not None or full_modules is not None
        self._full_steps = StepSelection(full_steps, every=full_every or 1) if full_wanted else None
        if compression not in (None, "gzip", "lzf"):
            raise ConfigError(f"compression must be gzip, lzf or none (got {compression!r})")
        self._include = module_matcher(modules, default=True)
        self._skip = module_matcher(exclude, default=False)
        self._full_match = module_matcher(full_modules, default=True)
        self.roots: dict[str, nn.Module] = {}
        self._modules: dict[str, nn.Module] = {}
        self._full_modules: set[str] = set()
        self._param_entries: list[Entry] = []
        self._buffer_entries: list[Entry] = []
        self._param_records = RecordsCache()
        self._param_ids: set[int] = set()  # every parameter of a recorded root
        self._entered: set[int] = set()  # parameters and buffers with a record of their own
        self._known: set[int] = set()  # ids of modules already named, or looked for
        self._prefixed: dict[str, bool] = {}  # by root: its modules' names carry its name
        self._root_names: dict[int, str] = {}  # by id of the module entered as a root
        self._where: dict[int, tuple[str, str]] = {}  # by module id: (root, qualname)
        self._layouts_seen: dict[int, list[int]] = {}  # by root id: its modules' ids
        self.rank = _rank()
        self._prepare_out(overwrite)

        config = {
            "modules": _describe(modules), "exclude": _describe(exclude), "every": every,
            "steps": _describe(steps), "inputs": inputs, "params": params,
            "full_every": full_every, "full_steps": _describe(full_steps),
            "full_modules": _describe(full_modules), "max_tensor_mb": max_tensor_mb,
            "max_units": max_units, "compression": compression, "buffer_mb": buffer_mb,
            "strict": strict, "capture_nonfinite": capture_nonfinite,
            "capture_limit": capture_limit, "capture_max_mb": capture_max_mb,
            "histograms": sorted(self._histogram_kinds), "histogram_every": histogram_every,
        }  # fmt: skip
        world_size = _world_size()
        manifest = {
            "format": schema.FORMAT_NAME,
            "format_version": schema.FORMAT_VERSION,
            "hooktrace_version": _version(),
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
            "platform": platform.platform(),
            "command": command if command is not None else list(sys.argv),
            "config": config,
            "roots": list(_name_roots(models)) if models is not None else [],
            "start_time": time.time(),
            "world_size": world_size,
        }
        self._writer = TraceWriter(
            self.out,
            rank=self.rank,
            manifest=manifest if self.rank == 0 else None,
            compression=compression,
            max_buffer_bytes=int(buffer_mb * (1 << 20)),
        )
        self.current_step = 0
        self.micro_step = 0
        self.histograms_failed = 0  # histograms not made, in the hooks (the writer counts its own)
        self.error: str | None = None
        self._active = True
        self._closed = False
        self._handles: list[RemovableHandle] = []
        self._tensor_handles: list[RemovableHandle] = []
        self._table = attach.ModuleTable()
        self._paused = 0  # > 0 while torch.jit.trace re-runs the model to check its graph
        self._restore: list[Callable[[], None]] = []  # undoes what was patched, in reverse
        self._compiled_calls: list[CompiledCall] = []
        self._prune_at = _PRUNE_AT
        # hooks may fire in several threads at once (nn.DataParallel's replicas, autograd's
        # device threads, a user's threads): each takes this lock for what it changes
        self._lock = threading.RLock()
        self._staging_pool = StagingPool()
        self._layouts = Layouts()
        if capture_limit < 0 or capture_max_mb < 0:
            raise ConfigError("capture_limit and capture_max_mb must be 0 or more")
        self._captures = capture.Captures(
            self.out,
            self.rank,
            enabled=capture_nonfinite,
            limit=capture_limit,
            max_mb=capture_max_mb,
            call_spec=self._call_spec,
            parameters=self._all_parameters,
            locate=self._locate,
            warn=_warn,
        )
        self._reset_step_state()
        self._root_depth = 0
        self._phase = "train"
        self._backward_active = False
        self._optimizer_owned: dict[int, bool] = {}
        self._unrecorded = 0  # optimizer steps of parameters no recorded model holds
        self._submitted = 0  # steps handed to the writer
        self._scratch = torch.empty(0, dtype=torch.float32)
        _ACTIVE = self
        try:
            if models is not None:
                lone = isinstance(models, nn.Module)
                for name, model in _name_roots(models).items():
                    self._add_root(name, model, prefixed=not lone)
            self._install()
        except BaseException:
            self.close(status=schema.STATUS_FAILED, error="hooks could not be installed")
            raise

    # -- public API --------------------------------------------------------------------------

    def step(self, *, skipped: bool = False) -> None:
        """Mark the end of a step, where no torch.optim optimizer marks it."""
        with self._lock:
            self._outside_forwards()
            self._end_step(skipped=skipped)

    def close(self, *, status: str = schema.STATUS_COMPLETE, error: str | None = None) -> None:
        """Flush what was recorded, remove every hook and finish the trace. Idempotent."""
        global _ACTIVE
        if self._closed:
            return
        self._closed = True
        finishing = status == schema.STATUS_COMPLETE  # not ended by an exception in flight
        try:
            with self._lock:
                if self._active and self._pending.meta:
                    self._submit()
        finally:
            with self._lock:
                self._active = False
                self._recording = False
                self._detach()
            if _ACTIVE is self:
                _ACTIVE = None
            if self.error is not None and status == schema.STATUS_COMPLETE:
                status = schema.STATUS_INCOMPLETE
            if status == schema.STATUS_COMPLETE and not self._submitted and self._unrecorded:
                status = schema.STATUS_INCOMPLETE
                error = error or (
                    f"an optimizer stepped {self._unrecorded} time(s), but no recorded model "
                    "holds its parameters: nothing was recorded"
                )
            extra = {
                **(_route_taken() or {}),
                **self._captures.status(),
                "histograms_failed": self.histograms_failed,  # the writer adds its own
            }
            problem = self._writer.close(status, error=error or self.error, extra=extra, warn=False)
        if problem is None:
            return
        if self.strict and finishing:
            raise RecordingError(f"hooktrace failed at the end of the recording: {problem}")
        # an exception in flight is the one to see: not replaced, even if strict
        _warn(f"hooktrace: {problem}; training was not affected")

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.close()
        elif isinstance(exc, KeyboardInterrupt):
            self.close(status=schema.STATUS_INCOMPLETE, error="interrupted (KeyboardInterrupt)")
        else:
            self.close(status=schema.STATUS_FAILED, error=f"{type(exc).__name__}: {exc}")

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("recording" if self._active else "stopped")
        return (
            f"<hooktrace Recorder {state} into '{self.out}': step {self.current_step}, "
            f"{len(self._modules)} modules, {self._writer.steps_written} steps written>"
        )

    # -- installing hooks --------------------------------------------------------------------

    def _install(self) -> None:
        self._handles.append(register_optimizer_step_pre_hook(self._optimizer_stepping))
        self._handles.append(register_optimizer_step_post_hook(self._optimizer_stepped))
        self._handles.extend(attach.install(pre=self._pre, post=self._post, exit=self._exit))
        self._patch(nn.Module, "compile", self._wrap_module_compile)
        self._patch(torch.jit._trace, "_check_trace", self._wrap_check_trace)
        self._patch(nn.Module, "_replicate_for_data_parallel", self._wrap_replicate)
        self._ignore_warning(_COMPILE_HOOKS_WARNING)

    def _patch(
        self, owner: Any, name: str, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> None:
        """Replace ``owner.name`` (a torch class or module) while recording; undone at close."""
        original = owner.__dict__[name]
        setattr(owner, name, functools.wraps(original)(wrap(original)))
        self._restore.append(lambda: setattr(owner, name, original))

    def _ignore_warning(self, message: str) -> None:
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

    def _wrap_module_compile(self, original: Callable[..., None]) -> Callable[..., None]:
        def compile(module: nn.Module, *args: Any, **kwargs: Any) -> None:
            original(module, *args, **kwargs)
            if self._active:
                with self._lock:
                    self._watch_compiled(module)
                    entry = self._table.get(module)
                    if entry is not None and entry.root:
                        self._warn_compiled(next(n for n, m in self.roots.items() if m is module))

        return compile

    def _watch_compiled(self, module: nn.Module) -> None:
        """nn.Module.compile() makes the module's calls skip every hook outside the compiled
        frame: its compiled call is wrapped in one that calls the hooks around it."""
        compiled = module.__dict__.get("_compiled_call_impl")
        if compiled is not None and not isinstance(compiled, CompiledCall):
            self._compiled_calls.append(CompiledCall(self, module, compiled))

    def _wrap_replicate(self, original: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
        def _replicate_for_data_parallel(module: nn.Module) -> nn.Module:
            # nn.DataParallel on several devices calls copies made each forward, never the
            # module itself: each copy is recorded as the module it copies
            replica = original(module)
            self._table.replica(replica, module)
            return replica

        return _replicate_for_data_parallel

    def _wrap_check_trace(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _check_trace(*args: Any, **kwargs: Any) -> Any:
            # torch.jit.trace runs the model again, eagerly, to compare: not a call of the run
            self._paused += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._paused -= 1

        return _check_trace

    def _add_root(self, root_name: str, root: nn.Module, *, prefixed: bool) -> nn.Module:
        """Name a root model's modules and parameters, and enter the modules selected in the
        table that the process-wide hooks consult (:mod:`hooktrace.recorder.attach`).

        Wrappers are looked through: DistributedDataParallel's ``module.`` and torch.compile's
        ``_orig_mod.`` never appear in names. A compiled model is recorded on the outside only
        (hooks inside a compiled graph would change it), with its parameters under its name.
        Modules already named (shared with an earlier root) keep their first name. Returns
        the module that was entered as the root.
        """
        inner, compiled = unwrap(root)
        hooked = root if compiled else inner
        if compiled:
            self._warn_compiled(root_name)
            self._known.update(id(m) for m in root.modules() if m is not root)
            if inner is root:  # nn.Module.compile(): its calls never reach a hook outside
                self._watch_compiled(root)
        self.roots[root_name] = hooked
        self._prefixed[root_name] = prefixed
        self._root_names[id(hooked)] = root_name
        self._table.add_root(hooked)
        self._add_modules(root_name, hooked, prefixed=prefixed, compiled=compiled)
        return hooked

    def _add_modules(
        self, root_name: str, root: nn.Module, *, prefixed: bool, compiled: bool
    ) -> None:
        """Name ``root``'s modules not named yet (a module shared with an earlier root keeps
        its first name), with their parameters and buffers, and enter the selected ones in
        the table."""
        new: dict[str, nn.Module] = {}
        for qualname, module in root.named_modules():
            if id(module) in self._known:
                continue
            self._known.add(id(module))
            self._where[id(module)] = (root_name, qualname)
            name = _qualified(root_name, qualname, prefixed)
            if self._include(name) and not self._skip(name):
                new[name] = module
        written = [name for name in new if name not in self._modules]
        self._modules.update(new)
        self._full_modules.update(name for name in new if self._full_match(name))
        inner, _ = unwrap(self.roots[root_name])
        params, buffers = [], []
        for qualname, param in inner.named_parameters():
            if id(param) in self._entered:
                continue
            self._param_ids.add(id(param))  # an optimizer holding it trains a recorded model
            entry = _entry(root_name, inner, qualname, prefixed=prefixed, compiled=compiled)
            if entry.module in new:
                self._entered.add(id(param))
                params.append(entry)
        for qualname, buffer in inner.named_buffers():
            if id(buffer) in self._entered:
                continue
            entry = _entry(root_name, inner, qualname, prefixed=prefixed, compiled=compiled)
            if entry.module in new:
                self._entered.add(id(buffer))
                buffers.append(entry)
        self._param_entries = _replaced(self._param_entries, params, set(new))
        self._buffer_entries = _replaced(self._buffer_entries, buffers, set(new))
        self._param_records = RecordsCache()  # built for the entries as they were
        for name, module in new.items():
            self._table.add(module, name, channels_first=isinstance(module, _CHANNELS_FIRST))
        self._writer.add_modules(self._module_rows(root_name, {n: new[n] for n in written}))

    def _restructure(self, root: nn.Module) -> None:
        """Name the modules assigned to ``root`` since it was last looked at (``model.head =
        nn.Linear(...)``, a module added, or one wrapped: ``m.fc = LoRA(m.fc)``), and enter
        them: checked at each step's first forward of the root, by the identity of its
        modules, so they are recorded from that step on. A module that moved within the
        root is renamed; the parameter records under a name changed are the new module's."""
        root_name = self._root_names.get(id(root))
        if root_name is None:
            return
        inner, compiled = unwrap(root)
        if compiled:
            return
        layout = [id(m) for m in inner.modules()]
        if layout == self._layouts_seen.get(id(root)):
            return
        self._layouts_seen[id(root)] = layout
        prefixed = self._prefixed[root_name]
        fresh: dict[str, nn.Module] = {}
        for qualname, module in inner.named_modules():
            where = self._where.get(id(module))
            if where == (root_name, qualname):
                continue
            if where is not None and _still_at(self.roots[where[0]], where[1], module):
                continue  # named where it still is (shared with another root, or a 2nd name)
            self._where[id(module)] = (root_name, qualname)
            self._known.add(id(module))
            name = _qualified(root_name, qualname, prefixed)
            if self._include(name) and not self._skip(name):
                fresh[name] = module
        if not fresh:
            return
        written = {n: m for n, m in fresh.items() if n not in self._modules}
        self._modules.update(fresh)
        self._full_modules.update(name for name in fresh if self._full_match(name))
        params, buffers = [], []
        for name, module in fresh.items():
            for attr, param in module.named_parameters(recurse=False):
                self._param_ids.add(id(param))
                self._entered.add(id(param))
                params.append(Entry.of(name, attr, module, attr))
            for attr, buffer in module.named_buffers(recurse=False):
                self._entered.add(id(buffer))
                buffers.append(Entry.of(name, attr, module, attr))
        self._param_entries = _replaced(self._param_entries, params, set(fresh))
        self._buffer_entries = _replaced(self._buffer_entries, buffers, set(fresh))
        self._param_records = RecordsCache()  # built for the entries as they were
        for name, module in fresh.items():
            self._table.name(module, name, channels_first=isinstance(module, _CHANNELS_FIRST))
        self._writer.add_modules(self._module_rows(root_name, written))

    def _warn_compiled(self, root_name: str) -> None:
        _warn(
            f"hooktrace: {root_name} runs under torch.compile: its outputs, gradients and "
            "parameters are recorded, its submodules are not (hooks inside a compiled graph "
            "would change it). Run with TORCHDYNAMO_DISABLE=1 to record every module."
        )

    # -- the process-wide hooks --------------------------------------------------------------
    #
    # torch calls them for every module call in the process. Each returns at once unless the
    # module is in the table; is_compiling() comes first, as dynamo cannot trace the look-up.

    def _pre(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None = None
    ) -> None:
        if is_compiling():
            return
        entry = self._table.get(module)
        if entry is None or not (entry.root or self.inputs) or self._paused or attach.traced():
            return
        if _in_backward() or _in_transform():
            return
        with self._lock:
            if entry.root:
                self._enter_root(module, args)
            if entry.name is not None and self.inputs and self._recording:
                try:
                    if kwargs is None:
                        kwargs = attach.call_kwargs()
                    with _unseen():
                        self._on_inputs(entry.name, module, args, kwargs)
                except Exception as exc:
                    self._fault(exc, f"the inputs of {entry.name!r}")

    def _post(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> None:
        if is_compiling():
            return
        entry = self._table.get(module)
        if entry is None or entry.name is None or not self._recording:
            return
        if self._paused or attach.traced() or _in_transform():
            return
        with self._lock:
            try:
                if type(output) is torch.Tensor:
                    self._on_forward(entry.name, module, args, kwargs, output, entry.channels_first)
                else:  # a container, or a tensor subclass: see _unseen()
                    with _unseen():
                        self._on_forward(
                            entry.name, module, args, kwargs, output, entry.channels_first
                        )
            except Exception as exc:
                self._fault(exc, f"the forward of {entry.name!r}")

    def _exit(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Runs after ``_post``, also when the forward raised: the root's records carry the
        root's phase, and an exception leaves no depth behind."""
        if is_compiling():
            return
        entry = self._table.get(module)
        if entry is None or not entry.root or self._paused or attach.traced():
            return
        if not _in_backward() and not _in_transform():
            with self._lock:
                self._root_depth = max(0, self._root_depth - 1)

    def _on_inputs(
        self, name: str, module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]
    ) -> None:
        phase = self._phase_of(module)
        call = self._calls.get((phase, name), 0)  # the forward hook counts the call
        full = self._full_step and name in self._full_modules
        if full:  # what replay needs to call the module again
            spec = self._call_spec(module, args, kwargs)
            if any(True for _ in flatten_call(args, kwargs)):
                self._pending.specs[len(self._pending.meta)] = spec
            else:  # no tensor input: the spec goes on the call's first output
                self._output_specs[(name, call)] = spec
        for slot, tensor in flatten_call(args, kwargs):
            self._observe(name, call, "input", slot, tensor, phase=phase, full=full, units=True)

    @staticmethod
    def _call_spec(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> str:
        spec = describe_call(args, kwargs)
        spec["training"] = module.training
        spec["grad_enabled"] = torch.is_grad_enabled()
        # dropout inside the module draws from here: replay restores it
        spec["cpu_rng_state"] = base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()
        return json.dumps(spec, separators=(",", ":"))

    def _phase_of(self, module: nn.Module) -> str:
        """Inside a root's forward, the root's phase; outside, the module's own."""
        if self._root_depth:
            return self._phase
        return "train" if torch.is_grad_enabled() and module.training else "eval"

    def _grad_hook(
        self, targets: list[tuple[str, int, str, str]]
    ) -> Callable[[torch.Tensor], None]:
        """A tensor's gradient hook: records the gradient as each (module, call, kind, slot)
        of ``targets`` (a tensor several modules returned is each one's output)."""

        def hook(grad: torch.Tensor) -> None:
            if self._recording and not _in_transform():
                with self._lock:
                    module = targets[0][0]
                    try:
                        stats = None
                        for module, call, kind, slot in targets:
                            stats = self._on_grad(module, call, kind, slot, grad)
                        if self._captures.armed:
                            self._after_gradient(targets, grad, stats)
                    except Exception as exc:
                        self._fault(exc, f"the backward of {module!r}")

        return hook

    def _hook_grad(
        self, tensor: torch.Tensor, module: str, call: int, kind: str, slot: str
    ) -> None:
        """Record ``tensor``'s gradient as (module, call, kind, slot). One hook a tensor: one
        returned again unchanged (a container's output is its last child's) takes one more
        target in the hook it has, not a hook of its own; unless another hook came after
        ours, which may change the gradient that the later module's record must see."""
        target = (module, call, kind, slot)
        hooked = self._hooked.get(id(tensor))
        if hooked is not None:
            seen, version, ours, targets = hooked
            hooks = tensor._backward_hooks
            # the same tensor, unchanged, and our hook still the last one on it
            if seen() is tensor and tensor._version == version and _last(hooks) == ours:
                targets.append(target)
                return
        targets = [target]
        handle = tensor.register_hook(self._grad_hook(targets))
        self._tensor_handles.append(handle)
        self._hooked[id(tensor)] = (weakref.ref(tensor), tensor._version, handle.id, targets)

    # -- what hooks do -----------------------------------------------------------------------

    def _enter_root(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if self._root_depth == 0:
            if self._backward_active:  # the last backward raised before it finished
                self._backward_active = False
            training = torch.is_grad_enabled() and module.training
            self._phase = "train" if training else "eval"
            if self._recording and self._params_phase is None:  # the step's first forward
                try:
                    self._restructure(module)
                except Exception as exc:
                    self._fault(exc, f"naming the modules of {type(module).__name__}")
            # parameters as the step's first forward finds them, and again as its first
            # training forward does, where an evaluation came first (an EMA callback may
            # have swapped them in for it): each phase's records hold what it used
            wanted = self._params_phase is None or (self._params_phase == "eval" and training)
            if self._recording and self.params and wanted:
                self._params_phase = self._phase
                try:
                    self._record_params("param")
                    self._record_params("buffer")
                except Exception as exc:
                    self._fault(exc, "the parameters")
        if self._root_depth == 0:
            self._captures.new_pass()
            if (
                self._captures.armed
                and self._recording
                and self._phase == "train"
                and not self._table.is_replica(module)  # held weakly: a re-run would keep it
            ):
                try:
                    self._captures.enter_root(module, args, attach.call_kwargs())
                except Exception as exc:  # a capture's failure is its own
                    where = self._where_now("train", 0)
                    self._captures.failure(exc, f"the forward of {type(module).__name__}", where)
        self._root_depth += 1

    def _on_forward(
        self,
        name: str,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        output: Any,
        channels_first: bool,
    ) -> None:
        if _in_backward():
            self._on_recompute(name, output)
            return
        phase = self._phase_of(module)
        key = (phase, name)
        call = self._calls.get(key, 0)
        self._calls[key] = call + 1
        full = self._full_step and name in self._full_modules
        spec = self._output_specs.pop((name, call), None) if self._output_specs else None
        if spec is not None:
            self._pending.specs[len(self._pending.meta)] = spec
        outputs = (("0", output),) if isinstance(output, torch.Tensor) else flatten(output)
        captures = self._captures
        armed = captures.armed
        nonfinite = hooked = False
        for slot, tensor in outputs:
            if channels_first and tensor.dim() == 3:
                self._channel_shapes.add(tensor.shape)
            stats = self._observe(
                name, call, "output", slot, tensor, phase=phase, full=full, units=True
            )
            if armed and not nonfinite:
                nonfinite = self._nonfinite(stats, tensor)
            if phase == "train" and tensor.requires_grad:
                hooked = True
                self._grad_hooked.add((name, call))
                self._hook_grad(tensor, name, call, "grad_output", slot)
        if not armed:
            return
        if hooked:
            captures.note_call((name, call), module)
        if nonfinite:
            where = self._where_now(phase, call)
            tensors = [("0", output)] if isinstance(output, torch.Tensor) else list(flatten(output))
            try:
                captures.after_forward(name, module, args, kwargs, tensors, where, self._queued)
            except Exception as exc:  # a capture's failure is its own: the recording goes on
                captures.failure(exc, f"the forward of {name!r}", where)

    def _nonfinite(self, stats: Any, tensor: torch.Tensor) -> bool:
        """Whether a recorded tensor holds a NaN or Inf, from its statistics where they are at
        hand (a CPU tensor's), else by a look of its own where that costs no host sync."""
        known = finite.nonfinite(stats, tensor, on_device=self._captures.device_checks)
        if known is not None:
            return known
        return isinstance(stats, Staged) and finite.check(tensor)

    def _queued(self, tensor: torch.Tensor) -> bool | None:
        """A tensor's non-finiteness from statistics already queued for it, if any."""
        cached = self._lookup(tensor)
        return finite.nonfinite(cached[0], tensor) if cached is not None else None

    def _where_now(self, phase: str, call: int) -> dict[str, Any]:
        return {"step": self.current_step, "micro_step": self.micro_step, "phase": phase,
                "call": call}  # fmt: skip

    def _locate(self, name: str) -> tuple[nn.Module, str] | None:
        """A recorded module by its trace name, and its qualified name inside its root."""
        module = self._modules.get(name)
        where = self._where.get(id(module)) if module is not None else None
        return (module, where[1]) if module is not None and where is not None else None

    def _all_parameters(self) -> list[torch.Tensor]:
        return [p for root in self.roots.values() for p in root.parameters()]

    def _on_recompute(self, name: str, output: Any) -> None:
        """A forward run again by activation checkpointing: record nothing twice.

        Non-reentrant checkpointing keeps the original graph, whose hooks already fire. The
        reentrant kind ran the original forward under no_grad, so gradients reach only the
        recomputed outputs: hook those, under the original call's index.
        """
        call = self._recompute_calls.get(name, 0)
        self._recompute_calls[name] = call + 1
        if (name, call) in self._grad_hooked:
            return
        for slot, tensor in flatten(output):
            if tensor.requires_grad:
                self._grad_hooked.add((name, call))
                self._hook_grad(tensor, name, call, "grad_output", slot)

    def _after_gradient(
        self,
        targets: list[tuple[str, int, str, str]],
        grad: torch.Tensor,
        stats: Any,
    ) -> None:
        try:
            bad = self._nonfinite(stats, grad)
            where = self._where_now("train", targets[0][1]) if bad else {}
            self._captures.after_gradient(targets, grad, bad, where)
        except Exception as exc:  # a capture's failure is its own: the recording goes on
            where = self._where_now("train", targets[0][1])
            self._captures.failure(exc, f"the backward of {targets[0][0]!r}", where)

    def _on_grad(self, module: str, call: int, kind: str, slot: str, grad: torch.Tensor) -> Any:
        if not self._backward_active:
            self._backward_active = True
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)
        full = self._full_step and self._wants_full(module)
        return self._observe(module, call, kind, slot, grad, phase="train", full=full, units=False)

    def _backward_done(self) -> None:
        """Queued on the autograd engine: runs once when a backward pass completes."""
        with self._lock:
            self._backward_active = False
            self.micro_step += 1
            self._calls.clear()
            self._grad_hooked.clear()
            self._hooked.clear()
            self._recompute_calls.clear()
            self._captures.backward_done()

    def watch(self, tensor: torch.Tensor, name: str) -> None:
        if not self._recording or _in_backward() or _in_transform():
            return
        with self._lock:
            try:
                phase = (
                    self._phase
                    if self._root_depth
                    else ("train" if torch.is_grad_enabled() else "eval")
                )
                key = (phase, name)
                call = self._calls.get(key, 0)
                self._calls[key] = call + 1
                full = self._full_step and self._wants_full(name)
                self._observe(name, call, "tensor", "0", tensor, phase=phase, full=full, units=True)
                if phase == "train" and tensor.requires_grad:
                    self._hook_grad(tensor, name, call, "grad_tensor", "0")
            except Exception as exc:
                self._fault(exc, f"the watched tensor {name!r}")

    def _observe(
        self,
        module: str,
        call: int,
        kind: str,
        slot: str,
        tensor: torch.Tensor,
        *,
        phase: str,
        full: bool,
        units: bool,
        note: str = "",
        histogram: bool = True,
    ) -> Any:
        """The hot path: queue this tensor's statistics (and its histogram, where its kind
        takes one this step, unless ``histogram`` is False: made elsewhere) and note where
        they belong. Returns the statistics (None for a tensor not summarised): a row on the
        CPU, a tensor on a device, or where they will be made from a staged copy."""
        if not usual(tensor):
            self._observe_unusual(module, call, kind, slot, tensor, phase=phase, full=full)
            return None
        pending = self._pending
        row = len(pending.meta)
        cached = self._lookup(tensor)
        if cached is None:
            dim = None
            if units and tensor.is_floating_point():
                channels_first = tensor.dim() == 3 and tensor.shape in self._channel_shapes
                dim = unit_dim(tensor, channels_first=channels_first)
                if dim is not None and not 0 < tensor.shape[dim] <= self.max_units:
                    dim = None
            counts: torch.Tensor | np.ndarray | StagedUnits | None = None
            if stageable(tensor):
                kernels = compiled_kernels()
                summed = kernels.summarize_in_place(tensor, dim) if kernels is not None else None
                if summed is not None:  # now, as the writer would from a copy
                    stats, counts = summed
                else:  # summarised later, with the step's other small tensors
                    stats = pending.stage(tensor)
                    if dim is not None:
                        counts = StagedUnits(stats.position, tuple(tensor.shape), dim)
            else:
                scratch = self._scratch_for(tensor)
                stats, counts = summarize_with_activity(tensor, dim, scratch=scratch)
            if not tensor.is_inference():  # inference tensors keep no version counter
                recent = self._recent  # (one C call each: hooks may fire in several threads)
                recent.pop(id(tensor), None)  # an earlier version of it: now the latest
                if len(recent) >= _RECENT:
                    recent.popitem(last=False)  # the oldest
                recent[id(tensor)] = (weakref.ref(tensor), tensor._version, stats, counts)
        else:
            stats, counts = cached
        n_units = unit_size = 0
        if counts is not None and units:
            n_units = counts.units if isinstance(counts, StagedUnits) else counts.shape[0]
            unit_size = tensor.numel() // max(n_units, 1)
            pending.activity.append((row, counts))
        pending.meta.append(
            Meta(self.micro_step, phase, module, call, kind, slot, tensor.dtype,
                 tuple(tensor.shape), n_units, unit_size, note)
        )  # fmt: skip
        pending.stats.append(stats)
        if histogram and kind in self._histogram_now:  # as the statistics: staged, or now
            binned = stats if type(stats) is Staged else self._histogram(histogram_of, tensor)
            if binned is not None:
                pending.histograms.append((row, binned))
        if full:
            self._snapshot(row, tensor)
        return stats

    def _observe_unusual(
        self,
        module: str,
        call: int,
        kind: str,
        slot: str,
        tensor: torch.Tensor,
        *,
        phase: str,
        full: bool,
    ) -> None:
        """A tensor that is not a plain dense one. Nested tensors are summarised over their
        values, Python subclasses as plain tensors; any other costs its own record only: a
        record with no statistics, whose note says why (the recording goes on)."""
        if python_subclass(tensor):
            tensor = plain(tensor)
            if usual(tensor):
                self._observe(module, call, kind, slot, tensor, phase=phase, full=full,
                              units=True, note="")  # fmt: skip
                return
        reason = unsupported(tensor)
        if reason is None:  # nested: summarised over its values
            values = nested_values(tensor)
            note = f"nested: statistics over the values of its {tensor.size(0)} components"
            self._observe(module, call, kind, slot, values, phase=phase, full=False,
                          units=False, note=note)  # fmt: skip
            return
        self._pending.meta.append(
            Meta(self.micro_step, phase, module, call, kind, slot, tensor.dtype,
                 shape_of(tensor), 0, 0, schema.NOTE_SKIPPED + reason)
        )  # fmt: skip
        self._pending.stats.append(None)

    def _scratch_for(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """One float32 buffer, grown to the largest CPU tensor seen, for counting in place on
        the eager route (the one-pass kernel needs none)."""
        # route() last: it loads numba, which a run with no large CPU tensor never needs
        if not tensor.is_cpu or tensor.numel() < 4096 or route().one_pass is not None:
            return None
        if self._scratch.numel() < tensor.numel():
            self._scratch = torch.empty(tensor.numel(), dtype=torch.float32)
        return self._scratch

    def _lookup(
        self, tensor: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """Statistics already queued for this very tensor (a container's output is its last
        child's output; one gradient reaches both): summarise each tensor once."""
        recent = self._recent.get(id(tensor))
        if recent is None:
            return None
        seen, version, stats, counts = recent
        if seen() is not tensor or tensor._version != version:
            return None
        return stats, counts

    def _snapshot(self, row: int, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.max_tensor_bytes:
            self._pending.dropped += 1
            return
        source = tensor.detach()
        if source.layout != torch.strided:
            source = source.to_dense()
        event = None
        if source.device.type == "cuda":
            copy = source.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        elif source.device.type == "cpu":
            copy = source.clone(memory_format=torch.contiguous_format)
        else:
            copy = source.to("cpu")
        self._pending.tensors.append((row, copy, event))
        self._pending.nbytes += nbytes

    def _wants_full(self, name: str) -> bool:
        if name in self._modules:
            return name in self._full_modules
        return bool(self._full_match(name))

    def _record_params(self, kind: str) -> None:
        """Parameters and buffers as the step's first forward finds them; gradients as
        accumulated at the step's end (labelled with the step's last micro-step)."""
        full_step = self._full_step
        saved_micro_step = self.micro_step
        if kind == "grad_param":
            self.micro_step = max(self.micro_step - 1, 0)
        try:
            self._record_param_values(kind, full_step)
        finally:
            self.micro_step = saved_micro_step

    def _record_param_values(self, kind: str, full_step: bool) -> None:
        """One record per entry, in order (:mod:`hooktrace.recorder.params`)."""
        phase = "train" if kind == "grad_param" else self._phase
        entries = self._buffer_entries if kind == "buffer" else self._param_entries
        values = values_of(entries, kind)
        records = self._param_records.records(
            entries,
            values,
            kind=kind,
            phase=phase,
            micro_step=self.micro_step,
            saved_whole=self._full_modules if full_step else (),
        )
        pending = self._pending
        stats = records.stage(values, pending.staging)
        first_row = len(pending.meta)
        wanted = kind in self._histogram_now
        batched = {i for i in records.observed if wanted and _plain_cpu(values[i])}
        done = 0
        for i in records.observed:
            pending.meta.extend(records.metas[done:i])
            pending.stats.extend(stats[done:i])
            module, slot, *_ = entries[i]
            full = full_step and module in self._full_modules
            self._observe(module, 0, kind, slot, values[i], phase=phase, full=full, units=False,  # type: ignore[arg-type]
                          histogram=i not in batched)  # fmt: skip
            done = i + 1
        pending.meta.extend(records.metas[done:])
        pending.stats.extend(stats[done:])
        if wanted:  # once the records are in: an interrupt before leaves none pointing past
            self._histogram_params(first_row, values, stats, sorted(batched))

    def _histogram_params(
        self,
        first_row: int,
        values: Sequence[torch.Tensor | None],
        stats: Sequence[Any],
        batched: Sequence[int],
    ) -> None:
        """The histograms of a kind's values, entry ``i`` being row ``first_row + i``: those
        staged, from their copies, in the writer; those read in place and the ``batched``
        ones (plain CPU tensors observed one by one), now, in one call. ``_observe`` made
        the other observed ones' (on a device, or not plain tensors)."""
        pending = self._pending
        now = sorted([i for i, s in enumerate(stats) if type(s) is np.ndarray] + list(batched))
        counts = self._histogram(histogram_many, [values[i] for i in now]) if now else None
        if counts is not None:
            pending.histograms.extend((first_row + i, c) for i, c in zip(now, counts, strict=True))
        pending.histograms.extend(
            (first_row + i, s) for i, s in enumerate(stats) if type(s) is Staged
        )

    def _histogram(self, make: Callable[[Any], Any], values: Any) -> Any:
        """``make(values)``, or None where it fails: a histogram that cannot be made costs
        itself, not the record nor the recording (a warning says so, once a run)."""
        try:
            return make(values)
        except Exception as exc:
            self.histograms_failed += 1
            if self.histograms_failed == 1:
                _warn(
                    f"hooktrace: a histogram could not be made ({type(exc).__name__}: {exc}); "
                    "the records go on without it (the status counts histograms_failed)"
                )
            return None

    # -- steps -------------------------------------------------------------------------------

    def _owned(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether the optimizer holds a parameter of a recorded model (asked once)."""
        owned = self._optimizer_owned.get(id(optimizer))
        if owned is None:
            owned = any(
                id(p) in self._param_ids
                for group in optimizer.param_groups
                for p in group["params"]
            )
            self._optimizer_owned[id(optimizer)] = owned
        return owned

    def _optimizer_stepping(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Before the update, while capture is armed: the gradients' records now (the step's
        end keeps them), whose NaN and Inf counts say, for free, whether a parameter's
        gradient is non-finite while the parameters are still those the backward used."""
        captures = self._captures
        if not (captures.armed and self._recording and self.params and self._owned(optimizer)):
            return
        with self._lock:
            if self._grads_recorded:
                return
            pending = self._pending
            first = len(pending.meta)
            try:
                self._record_params("grad_param")
            except Exception as exc:
                self._fault(exc, f"the gradients at step {self.current_step}")
                return
            self._grads_recorded = True
            where = self._where_now("train", 0)
            where["micro_step"] = max(self.micro_step - 1, 0)  # the last backward's
            try:
                if self._nonfinite_rows(first):
                    captures.after_gradients(where)
            except Exception as exc:  # a capture's failure is its own
                captures.failure(exc, "the parameters' gradients", where)

    def _nonfinite_rows(self, first: int) -> bool:
        """Whether a record of the step from row ``first`` on holds a NaN or Inf: from its
        row where that is on the host (the kernel summarised it in place), else from its
        staged copy (no numba, or a half precision value)."""
        pending = self._pending
        bounds = values = None
        for stats in pending.stats[first:]:
            if stats is None:
                continue
            if isinstance(stats, Staged):
                if bounds is None:
                    bounds, values = pending.staging.bounds(), pending.staging.values()
                lo, hi = bounds[stats.position], bounds[stats.position + 1]
                if not np.isfinite(values[lo:hi]).all():  # type: ignore[index]
                    return True
            elif finite.nonfinite(stats, on_device=self._captures.device_checks):
                return True
        return False

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        owned = self._owned(optimizer)
        if owned:
            with self._lock:
                self._outside_forwards()
                self._end_step()
        else:
            self._unrecorded += 1

    def _end_step(self, *, skipped: bool = False) -> None:
        if self._closed:
            raise RecordingError("step() after close(): the recording has ended")
        if self._recording:
            try:
                if self.params and not self._grads_recorded:
                    self._record_params("grad_param")
                self._pending.skipped = skipped
                self._submit()
            except Exception as exc:
                self._fault(exc, f"the end of step {self.current_step}")
        if self._writer.error is not None and self._active:
            self._fault(self._writer.error, "the trace writer")
        self.current_step += 1
        self.micro_step = 0
        self._reset_step_state()

    def _outside_forwards(self) -> None:
        """At an optimizer step no forward runs: a root's forward that a BaseException ended
        (a KeyboardInterrupt the script caught) skipped the hook that leaves it."""
        self._root_depth = 0

    def _submit(self) -> None:
        pending = self._pending
        # a signal can land between a hook's two appends: keep only whole records
        whole = min(len(pending.meta), len(pending.stats))
        if whole < max(len(pending.meta), len(pending.stats)):
            del pending.meta[whole:], pending.stats[whole:]
            pending.activity = [(row, counts) for row, counts in pending.activity if row < whole]
            pending.tensors = [item for item in pending.tensors if item[0] < whole]
            pending.specs = {row: spec for row, spec in pending.specs.items() if row < whole}
            pending.histograms = [item for item in pending.histograms if item[0] < whole]
        pending.micro_steps = self.micro_step
        pending.end_time = time.time()
        pending.nbytes += 96 * len(pending.meta) + pending.staging.nbytes
        pending.nbytes += HISTOGRAM_WIDTH * 8 * len(pending.histograms)  # made whole there
        self._pending = self._new_pending()
        self._recent.clear()
        self._writer.submit(pending)
        self._submitted += 1
        self._table.drop_dead_replicas()
        # the gradient hooks of a graph that is gone need no removing: their handles are
        # dropped now and then (a handle keeps no tensor alive)
        if len(self._tensor_handles) >= self._prune_at:
            self._tensor_handles = [h for h in self._tensor_handles if _alive(h)]
            self._prune_at = max(_PRUNE_AT, 2 * len(self._tensor_handles))

    def _new_pending(self) -> PendingStep:
        return PendingStep(
            self.current_step,
            time.time(),
            staging=Staging(self._staging_pool),
            layouts=self._layouts,
        )

    def _reset_step_state(self) -> None:
        self._recording = self._active and self.current_step in self._steps
        self._full_step = (
            self._recording
            and self._full_steps is not None
            and self.current_step in self._full_steps
        )
        self._histogram_now = (
            self._histogram_kinds
            if self._recording and self.current_step % self._histogram_every == 0
            else frozenset()
        )
        self._pending = self._new_pending()
        self._calls = {}
        self._recompute_calls = {}
        self._grad_hooked = set()
        self._hooked = {}
        self._channel_shapes = set()
        self._recent = OrderedDict()
        self._params_phase = None
        self._output_specs = {}
        self._grads_recorded = False
        self._captures.new_step(device_checks=self._writer.nonfinite_seen)

    def _orphan(self) -> None:
        """In a forked child: hooks return at once, nothing is written, nothing is closed."""
        self._active = False
        self._recording = False
        self._closed = True
        self._detach()  # the child's copies: its modules run without them

    def _detach(self) -> None:
        """Remove every hook and patch, and empty the table: torch is as it was."""
        for handle in (*self._handles, *self._tensor_handles):
            handle.remove()
        self._handles.clear()
        self._tensor_handles.clear()
        self._table.clear()
        for compiled_call in self._compiled_calls:
            compiled_call.restore()
        self._compiled_calls.clear()
        while self._restore:
            self._restore.pop()()

    # -- faults ------------------------------------------------------------------------------

    def _fault(self, exc: BaseException, where: str) -> None:
        message = (
            f"hooktrace failed in {where} at step {self.current_step}: {type(exc).__name__}: "
            f"{str(exc).rstrip('. ')}"
        )
        if self.strict:
            raise RecordingError(message) from exc
        if self._active:
            _warn(
                f"{message}. Recording stopped; training goes on and the trace keeps every step "
                f"written before (in {self.out})."
            )
        self.error = self.error or message
        self._active = False
        self._recording = False
        self._pending = self._new_pending()

    # -- set-up helpers ----------------------------------------------------------------------

    def _prepare_out(self, overwrite: bool) -> None:
        if self.out.exists() and not self.out.is_dir():
            raise ConfigError(f"{self.out} is a file: give a directory for the trace")
        if (self.out / schema.MANIFEST).exists() and self.rank == 0 and not overwrite:
            raise ConfigError(
                f"{self.out} already holds a trace: choose another output directory, delete it, "
                "or pass overwrite=True"
            )
        if overwrite:
            _clear_trace(self.out, rank=self.rank, world_size=_world_size())
        try:
            self.out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(
                f"cannot create {self.out}: {exc.strerror}; choose a writable directory"
            ) from exc

    def _module_rows(self, root_name: str, modules: dict[str, nn.Module]) -> list[dict[str, Any]]:
        rows = []
        for name, module in modules.items():
            parent = name.rpartition(".")[0]
            rows.append(
                {
                    "module": name,
                    "type": f"{type(module).__module__}.{type(module).__qualname__}",
                    "root": root_name,
                    "parent": parent
                    if parent in self._modules
                    else ("" if name == root_name else root_name),
                    "depth": 0
                    if name == root_name
                    else name.count(".") + (0 if name.startswith(root_name + ".") else 1),
                    "parameters": _parameter_count(module),
                    "first_step": self.current_step,
                }
            )
        return rows


def _still_at(root: nn.Module, qualname: str, module: nn.Module) -> bool:
    inner, _ = unwrap(root)
    try:
        return inner.get_submodule(qualname) is module
    except AttributeError:
        return False


def _replaced(entries: list[Entry], fresh: list[Entry], names: set[str]) -> list[Entry]:
    """``entries`` with ``fresh`` ones added, the modules ``names`` were just given to. The
    entries of a module those names had before (one replaced since), and of the modules
    inside it, give way: they are no longer in the model."""
    if not names:
        return entries
    stale = tuple(f"{name}." for name in names)
    kept = [e for e in entries if e.module not in names and not e.module.startswith(stale)]
    return kept + fresh


def _unseen() -> Any:
    """A tensor subclass's ``__torch_function__`` sees every attribute read and every
    operation on its tensors: within this, the recorder's reach it not, so a script's
    subclass cannot tell it is recorded."""
    return torch._C.DisableTorchFunctionSubclass()


def _parameter_count(module: nn.Module) -> int:
    """Values in ``module``'s parameters; a lazy module's count none until its first call."""
    from torch.nn.parameter import UninitializedTensorMixin as lazy  # type: ignore[attr-defined]

    return sum(p.numel() for p in module.parameters() if not isinstance(p, lazy))


def _name_roots(models: Models) -> dict[str, nn.Module]:
    """Root names: a lone model is named by its class; several are named by key or class."""
    if isinstance(models, nn.Module):
        return {type(unwrap(models)[0]).__name__: models}
    if isinstance(models, Mapping):
        roots = dict(models)
    else:
        roots = {}
        for model in models:
            base = type(unwrap(model)[0]).__name__
            name, n = base, 1
            while name in roots:
                name, n = f"{base}#{n}", n + 1
            roots[name] = model
    if not roots or not all(isinstance(m, nn.Module) for m in roots.values()):
        raise ConfigError("record() takes an nn.Module, a dict of them by name, or a list of them")
    return roots


def unwrap(module: nn.Module) -> tuple[nn.Module, bool]:
    """The model inside DDP / DataParallel / torch.compile wrappers; and whether compiled
    (by torch.compile, or in place by nn.Module.compile)."""
    compiled = False
    while True:
        compiled = compiled or module.__dict__.get("_compiled_call_impl") is not None
        kind = type(module).__name__
        inner = getattr(module, "_orig_mod" if kind == "OptimizedModule" else "module", None)
        if kind in ("OptimizedModule", "DistributedDataParallel", "DataParallel") and isinstance(
            inner, nn.Module
        ):
            compiled = compiled or kind == "OptimizedModule"
            module = inner
        else:
            return module, compiled


class CompiledCall:
    """Stands in for the compiled call of a module compiled in place (nn.Module.compile):
    torch calls it instead of the module's hooks, so it calls the recorder's around the
    compiled function. It sits in the module's ``_compiled_call_impl``, which
    ``nn.Module.__getstate__`` leaves out: pickling, ``torch.save`` and copies never see it.
    The recorder puts the compiled function back when it closes."""

    def __init__(self, recorder: Recorder, module: nn.Module, compiled: Callable[..., Any]):
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


def _entry(
    root_name: str, inner: nn.Module, qualname: str, *, prefixed: bool, compiled: bool
) -> Entry:
    """A parameter or buffer of ``inner`` (a root) by its qualified name: under its own
    module, or under the root where the root is compiled (its submodules are not recorded)."""
    owner, _, attr = qualname.rpartition(".")
    found = inner.get_submodule(owner)
    if compiled:
        return Entry.of(_qualified(root_name, "", prefixed), qualname, found, attr)
    return Entry.of(_qualified(root_name, owner, prefixed), attr, found, attr)


def _qualified(root_name: str, qualname: str, prefixed: bool) -> str:
    """A module's name: the root's name for the root itself; its qualified name inside a
    lone model; ``root.qualname`` when several models are recorded."""
    if not qualname:
        return root_name
    return f"{root_name}.{qualname}" if prefixed else qualname


_INTERNAL = tuple(
    str(Path(m.__file__ or "").parent) + os.sep for m in (sys.modules["hooktrace"], torch)
)


def _route_taken() -> dict[str, Any] | None:
    """How this process summarised large CPU tensors, for the final status (None: none were)."""
    taken = route_taken()
    if taken is None:
        return None
    return {"stats_route": taken.description, "stats_warmup_seconds": round(taken.warmup_s, 3)}


def _warn(message: str) -> None:
    """A RuntimeWarning pointing at the user's line. Where the script made warnings errors
    (``-W error``, pytest's ``filterwarnings = error``) it would raise inside the script's
    forward or backward call: the message is printed to stderr instead."""
    try:
        warnings.warn(message, RuntimeWarning, stacklevel=_caller_outside())
    except Warning:
        print(message, file=sys.stderr, flush=True)


def _caller_outside() -> int:
    """The ``stacklevel`` that makes a warning raised by the caller point at the first line
    outside hooktrace and torch: the user's forward call or ``loss.backward()``. Hooks that
    autograd runs on its own threads have no such line: the caller's caller then."""
    frame: FrameType | None = sys._getframe(1)  # the function calling warnings.warn: level 1
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_INTERNAL):
        frame, level = frame.f_back, level + 1
    return level if frame is not None else 2


def _last(hooks: Mapping[int, Any] | None) -> int | None:
    """The id of the hook registered last among ``hooks`` (a tensor's ``_backward_hooks``)."""
    return next(reversed(hooks)) if hooks else None


def _alive(handle: RemovableHandle) -> bool:
    return handle.hooks_dict_ref() is not None


def _plain_cpu(value: torch.Tensor | None) -> bool:
    """A value whose record ``_observe`` makes as it is (no unusual route) on the CPU."""
    return value is not None and usual(value) and value.is_cpu


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return int(torch.distributed.get_rank())
    return int(os.environ.get("RANK", "0"))


def _describe(spec: Any) -> Any:
    if spec is None or isinstance(spec, (str, int, float, bool)):
        return spec
    if callable(spec):
        return f"<function {getattr(spec, '__qualname__', repr(spec))}>"
    try:
        return [_describe(s) if not isinstance(s, range) else str(s) for s in spec]
    except TypeError:
        return repr(spec)


_RANK_DIRS = (schema.RECORDS_DIR, schema.STEPS_DIR, schema.MODULES_DIR, schema.TENSORS_DIR)


def _clear_trace(out: Path, *, rank: int, world_size: int) -> None:
    """Remove what an earlier recording left of this rank; rank 0 also removes the manifest
    and the ranks beyond this run's. Each rank removes its own only: under torchrun, rank 0
    removing every rank's folders killed the writer of a rank that had begun writing."""
    import shutil

    ranks = {rank} | (set() if rank else _ranks_in(out) - set(range(world_size)))
    for name in (*_RANK_DIRS, CAPTURES_DIR, HISTOGRAMS_DIR):
        for r in ranks:
            shutil.rmtree(out / schema.rank_dir(name, r), ignore_errors=True)
    for r in ranks:
        (out / schema.STATUS_DIR / f"rank={r}.json").unlink(missing_ok=True)
    if rank == 0:
        (out / schema.MANIFEST).unlink(missing_ok=True)


def _ranks_in(out: Path) -> set[int]:
    found = set()
    for path in out.glob("*/rank=*"):
        number = path.name.removeprefix("rank=").removesuffix(".json")
        if number.isdigit():
            found.add(int(number))
    return found


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def _version() -> str:
    from hooktrace import __version__

    return __version__
