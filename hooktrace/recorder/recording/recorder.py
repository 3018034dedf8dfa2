"""The recorder: hooks on modules, tensors and optimizers, and the step they belong to.

Hooks only observe: they queue statistics on the tensor's device and append to lists. At each
step boundary the step's observations go to the background writer. A fault inside hooktrace
warns once and stops recording (``strict=True`` raises instead); the trace written so far is
kept. Every hook is removed when the recorder closes, normally or by an exception.

Here the :class:`Recorder` owns the recording's state: it is set up, installed, and ended
here. What happens in between lives apart, in the order data flows: the process-wide hooks
and the patches of torch (``attach``, ``patches``), the roots and names (``names``), what a
hook does (``hooks``, ``calls``), the hot path from a tensor to a queued record
(``observe``), the parameters (``params``), the step's end (``steps``), the captures of a
first NaN (``capture``), warnings (``faults``) and the run directory (``rundir``).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils.hooks import RemovableHandle

from hooktrace.errors import ConfigError, RecordingError
from hooktrace.recorder.graphs import backend as graphs
from hooktrace.recorder.graphs.plan import Plan
from hooktrace.recorder.hooks.calls import Calls
from hooktrace.recorder.hooks.compiled import CompiledCalls
from hooktrace.recorder.hooks.hooks import attach, call_spec
from hooktrace.recorder.hooks.names import Models, Names, name_roots, unwrap
from hooktrace.recorder.hooks.select import (
    ModuleFilter,
    Sampling,
    StepSpec,
    check_options,
    module_matcher,
)
from hooktrace.recorder.hooks.steps import Optimizers, Steps
from hooktrace.recorder.nonfinite import capture
from hooktrace.recorder.recording import rundir
from hooktrace.recorder.recording.faults import fault_message
from hooktrace.recorder.recording.faults import warn as _warn
from hooktrace.recorder.recording.patches import (
    Patches,
    replicas_recorded,
)
from hooktrace.recorder.records.layout import Layouts
from hooktrace.recorder.records.observe import Histograms, Observer
from hooktrace.recorder.records.shards import data_parallel
from hooktrace.recorder.records.staging import StagingPool
from hooktrace.recorder.stats.stats import route_taken
from hooktrace.trace import schema
from hooktrace.trace.paths import one_line
from hooktrace.trace.writer import HOLD_STEPS, TraceWriter

__all__ = ["DEFAULT_HISTOGRAMS", "Models", "Recorder", "active_recorder", "unwrap"]

DEFAULT_HISTOGRAMS = ("param", "grad_param")
"""The record kinds histogrammed unless told otherwise (docs/FORMAT.md, "histograms")."""

_ACTIVE: Recorder | None = None


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


def _nothing_selected(roots: list[str], names: list[str], config: dict[str, Any]) -> str:
    """What a recording whose module filter selected none of its models' modules (of
    ``names``, roots included) is told at once: its trace would hold steps and no record."""
    chosen = "; ".join(
        f"{o}={config[o]!r}" for o in ("modules", "exclude") if config[o] is not None
    )
    inside = [name for name in names if name not in roots][:3]
    like = f" (names such as {', '.join(map(repr, inside))})" if inside else ""
    return (
        f"hooktrace: {chosen} selects no module of {', '.join(roots)}{like}: unless one it "
        "selects is added to the model later, the trace will hold steps and no record"
    )


class Recorder(Steps):
    """Records the named modules of one or more models into a run directory.

    Use :func:`hooktrace.record` to make one. Steps advance on each optimizer step (any
    ``torch.optim`` optimizer holding a recorded parameter) and on :meth:`step`.
    """

    out: Path  # the per-step state is declared where it is used: hooks.py, steps.py

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
        if not isinstance(out, (str, os.PathLike)) or not os.fspath(out):
            raise ConfigError(f"record() writes into a directory: give its path, not {out!r}")
        named = name_roots(models) if models is not None else {}  # before anything is made
        check_options({
            "inputs": inputs, "params": params, "strict": strict, "overwrite": overwrite,
            "capture_nonfinite": capture_nonfinite, "max_tensor_mb": max_tensor_mb,
            "max_units": max_units, "buffer_mb": buffer_mb, "capture_limit": capture_limit,
            "capture_max_mb": capture_max_mb,
        })  # fmt: skip
        self.out = Path(out)
        self.strict = strict
        self.inputs = inputs
        self.params = params
        self.max_tensor_bytes = int(max_tensor_mb * (1 << 20))
        self.max_units = max_units
        self._sampling = Sampling(
            every=every,
            steps=steps,
            full_every=full_every,
            full_steps=full_steps,
            full_modules=full_modules,
            histograms=histograms,
            histogram_every=histogram_every,
        )
        if compression not in (None, "gzip", "lzf"):
            raise ConfigError(f"compression must be gzip, lzf or none (got {compression!r})")
        self._table = attach.ModuleTable()
        self._wrappers: list[weakref.ref[nn.Module]] = []  # DDP's, for the status's layout
        self._place: dict[str, Any] = {}  # the status's data_parallel, once told
        self._place_tries = 0
        self._names = Names(
            self._table,
            include=module_matcher(modules, default=True),
            skip=module_matcher(exclude, default=False),
            full=module_matcher(full_modules, default=True),
        )
        self.rank = rundir.rank()
        rundir.prepare_out(self.out, rank=self.rank, overwrite=overwrite)

        describe = rundir.describe
        config = {
            "modules": describe(modules), "exclude": describe(exclude), "every": every,
            "steps": describe(steps), "inputs": inputs, "params": params,
            "full_every": full_every, "full_steps": describe(full_steps),
            "full_modules": describe(full_modules), "max_tensor_mb": max_tensor_mb,
            "max_units": max_units, "compression": compression, "buffer_mb": buffer_mb,
            "strict": strict, "capture_nonfinite": capture_nonfinite,
            "capture_limit": capture_limit, "capture_max_mb": capture_max_mb,
            "histograms": sorted(self._sampling.histogram_kinds), "histogram_every": histogram_every,
        }  # fmt: skip
        self._writer = TraceWriter(
            self.out,
            rank=self.rank,
            manifest=rundir.manifest(config=config, roots=list(named), command=command)
            if self.rank == 0
            else None,
            compression=compression,
            max_buffer_bytes=int(buffer_mb * (1 << 20)),
        )
        self.current_step = 0
        self.micro_step = 0
        self.error: str | None = None
        self._active = True
        self._closed = False
        self._handles: list[RemovableHandle] = []  # the process-wide and optimizer hooks'
        self._calls = Calls()
        self._compiled = CompiledCalls(self._names, self._table)
        self._graph_failures = 0
        self._values_failures = 0  # graphs whose values-returning variant failed to compile
        self._notes: list[str] = []  # what the trace lacks and why, for the rank's status
        self._dtensor_outputs: list[str] = []  # modules whose DTensor outputs of dynamic
        # shapes inside compiled graphs go unrecorded
        self._unopened: list[str] = []  # modules inside regions of compiled graphs not opened
        self._paused = 0  # > 0 while torch.jit.trace re-runs the model to check its graph
        self._patches = Patches()
        # hooks may fire in several threads at once (nn.DataParallel's replicas, autograd's
        # device threads, a user's threads): each takes this lock for what it changes
        self._lock = threading.RLock()
        self._staging_pool = StagingPool()
        # a block of histograms a step for each kind: parameters, buffers, gradients
        self._counts_pool = StagingPool(dtype=torch.int64, keep=3 * (HOLD_STEPS + 4))
        self._layouts = Layouts()
        self._observer = Observer(
            max_units=max_units,
            max_tensor_bytes=self.max_tensor_bytes,
            histograms=Histograms(_warn),
        )
        self._captures = capture.Captures(
            self.out,
            self.rank,
            enabled=capture_nonfinite,
            limit=capture_limit,
            max_mb=capture_max_mb,
            call_spec=call_spec,
            parameters=self._names.all_parameters,
            locate=self._names.locate,
            warn=_warn,
        )
        self._reset_step_state()
        self._root_depth = 0
        self._began: Plan | None = None  # a graph whose first root forward is entered
        self._root_thread = 0
        self._phase = "train"
        self._backward_active = False
        self._owners = Optimizers(self._names.param_ids)
        self._unrecorded = 0  # optimizer steps of parameters no recorded model holds
        self._submitted = 0  # steps handed to the writer
        _ACTIVE = self
        try:
            if models is not None:
                lone = isinstance(models, nn.Module)
                for name, model in named.items():
                    self._add_root(name, model, prefixed=not lone)
                if not self._names.modules and (modules is not None or exclude is not None):
                    _warn(_nothing_selected(list(named), self._names.every_name(), config))
            self._install()
        except BaseException:
            self.close(status=schema.STATUS_FAILED, error="hooks could not be installed")
            raise

    @property
    def roots(self) -> dict[str, nn.Module]:
        """The root models recorded, by name."""
        return self._names.roots

    @property
    def histograms_failed(self) -> int:
        """Histograms not made, in the hooks (the writer counts its own)."""
        return self._observer.histograms.failed

    # -- public API --------------------------------------------------------------------------

    def step(self, *, skipped: bool = False) -> None:
        """Mark the end of a step, where no torch.optim optimizer marks it."""
        with self._lock:
            self._outside_forwards()
            self._end_step(skipped=skipped)

    _unrecorded_hint = ""
    """Said after "nothing was recorded": where the models may be that the recording missed."""

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
                    f"holds its parameters: nothing was recorded{self._unrecorded_hint}"
                )
            extra = {
                **(_route_taken() or {}),
                **(self._place or self._layout()),
                **self._captures.status(),
                "histograms_failed": self.histograms_failed,  # the writer adds its own
                **self._status_notes(),
            }
            problem = self._writer.close(status, error=error or self.error, extra=extra, warn=False)
        if problem is None:
            return
        if self.strict and finishing:
            raise RecordingError(f"hooktrace failed at the end of the recording: {problem}")
        # an exception in flight is the one to see: not replaced, even if strict
        _warn(f"hooktrace: {problem}; training was not affected")

    def __enter__(self) -> Recorder:
        if self._closed:  # its hooks are gone: a with block would record nothing, silently
            raise RecordingError(
                f"the recording into {self.out} has ended: start another with hooktrace.record()"
            )
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
            f"{len(self._names.modules)} modules, {self._writer.steps_written} steps written>"
        )

    # -- installing hooks --------------------------------------------------------------------

    def _install(self) -> None:
        steps = [
            register_optimizer_step_pre_hook(self._optimizer_stepping),
            register_optimizer_step_post_hook(self._optimizer_stepped),
        ]
        self._handles.extend(steps)
        process_wide = attach.install(pre=self._pre, post=self._post)
        self._handles.extend(process_wide)
        patch = self._patches.patch
        patch(torch.jit._trace, "_check_trace", self._wrap_check_trace)
        patch(nn.Module, "_replicate_for_data_parallel", replicas_recorded(self._table))
        self._patches.hide_hooks_from_compile([handle.id for handle in process_wide])
        hooks = [
            cls.__dict__[name].__code__
            for cls in type(self).__mro__
            for name in ("_pre", "_post", "_returned", "_exit")
            if name in cls.__dict__
        ]
        self._patches.instrument_graphs(graphs.wrap_call_user_compiler, hooks, untraced=steps)
        graphs.receive(self)

    @property
    def skips_steps(self) -> bool:
        """Whether some steps go unrecorded (graphs compile a variant without statistics)."""
        steps = self._sampling.steps
        return steps.every > 1 or steps.ranges is not None

    @property
    def recording_graphs(self) -> bool:
        return self._recording

    @property
    def saves_full(self) -> bool:
        """Whether some steps need the values inside graphs (graphs compile a variant that
        returns them): steps that save tensors whole, or histograms of the kinds graphs
        record (outputs, their gradients, inputs)."""
        sampling = self._sampling
        return sampling.full_steps is not None or bool(sampling.histogram_kinds & _GRAPH_KINDS)

    @property
    def full_graphs(self) -> bool:
        return self._recording and (
            self._full_step or bool(self._observer.histogram_now & _GRAPH_KINDS)
        )

    def graph_values_failed(self, exc: BaseException) -> None:
        """A graph that returns its values could not be compiled: on the steps that save
        tensors whole, its modules' statistics are recorded, not their tensors."""
        if self.strict:
            raise RecordingError(
                fault_message(exc, "compiling a graph that returns its values", self.current_step)
            ) from exc
        self._values_failures += 1
        if self._values_failures == 1:
            self._note(
                f"compiling a graph that returns its values failed ({type(exc).__name__}: "
                f"{one_line(exc)}); on the steps that save tensors whole or histogram "
                "outputs, the modules inside it record their statistics only"
            )

    def records_module(self, module_id: int) -> bool:
        entry = self._table.by_id(module_id)
        return entry is not None and entry.name is not None

    finds_models = False
    """The models are the ones given (:class:`ScriptRecorder` finds its own)."""

    def graph_calls(self, modules: Sequence[Any]) -> None:
        """Nothing: the models are the ones given."""

    def records_alike(self, module: Any) -> bool:
        """Whether ``module`` is not recorded but a module of its type is: dynamo may run a
        graph compiled for one for the other (it checks a module's type, not which one it
        is, as it must to run one graph for every block of a model)."""
        return (
            isinstance(module, nn.Module)
            and self._table.get(module) is None
            and self._table.records_a(type(module))
        )

    def runs_recorded(self, plan: Plan, args: tuple[Any, ...]) -> bool:
        """Whether this run of a graph compiled for a module alike (:meth:`records_alike`)
        is a recorded module's: its anchors name one (a watched tensor's name is no
        module's)."""
        with self._lock:  # (graphs may run in several threads)
            entries = self._compiled.modules(plan, args)
            return any(entry is not None and entry.module is not None for entry in entries)

    def _compiled_before(self, entry: Any) -> None:
        if self._graph_failures:  # its graphs were not instrumented: that is said already
            return
        self._note(
            f"{entry.name or 'a compiled model'} runs graphs that were compiled before the "
            "recording began: the modules inside them are not recorded, only its outputs and "
            "parameters. Start recording before the model's first call (or call "
            "torch._dynamo.reset() first)."
        )

    def _status_notes(self) -> dict[str, list[str]]:
        notes = list(self._notes)
        if self._dtensor_outputs:
            notes.append(_dtensor_note(self._dtensor_outputs))
        if self._unopened:
            notes.append(_unopened_note(self._unopened))
        return {"notes": notes} if notes else {}

    def _note(self, text: str) -> None:
        """Say once what the trace lacks and why: a warning now, and a note in the rank's
        status (``hooktrace summary`` shows it)."""
        if text not in self._notes:
            self._notes.append(text)
            _warn(f"hooktrace: {text}")

    def graph_left_out(self, path: str) -> None:
        """Inside a compiled graph, the output of the module at ``path`` (from the compiled
        frame) is a DTensor of a dynamic shape: it is left out, with its gradient; said once
        a run, and in the status."""
        name = path or "a module"
        if name in self._dtensor_outputs:
            return
        self._dtensor_outputs.append(name)
        if len(self._dtensor_outputs) == 1:
            _warn(f"hooktrace: {_dtensor_note(self._dtensor_outputs)}")

    def graph_regions_unopened(self, paths: list[str]) -> None:
        """Inside a compiled graph, the modules at ``paths`` run in a region the recorder
        does not open (``torch.cond``'s branches, ``while_loop``'s body): said once a run,
        and in the status."""
        new = [path or "a module" for path in paths]
        new = [path for path in new if path not in self._unopened]
        if not new:
            return
        first = not self._unopened
        self._unopened.extend(new)
        if first:
            _warn(f"hooktrace: {_unopened_note(self._unopened)}")

    def graph_failed(self, exc: BaseException, what: str) -> None:
        """A graph could not be instrumented: it is compiled as the script asked, and its
        modules are recorded from the outside only."""
        if self.strict:
            raise RecordingError(fault_message(exc, what, self.current_step)) from exc
        self._graph_failures += 1
        if self._graph_failures == 1:
            self._note(
                f"{what} failed ({type(exc).__name__}: {one_line(exc)}); that graph runs as "
                "compiled by the script, and the modules inside it are not recorded"
            )

    def _wrap_check_trace(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def _check_trace(*args: Any, **kwargs: Any) -> Any:
            # torch.jit.trace runs the model again, eagerly, to compare: not a call of the run
            self._paused += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._paused -= 1

        return _check_trace

    # -- roots and names ---------------------------------------------------------------------

    def _add_root(self, root_name: str, root: nn.Module, *, prefixed: bool) -> nn.Module:
        """Name a root model's modules and parameters (:class:`Names`) and write their rows.

        Wrappers are looked through: DistributedDataParallel's ``module.`` and torch.compile's
        ``_orig_mod.`` never appear in names. A compiled model's modules are named as an
        eager one's: their records come from its graphs (:mod:`hooktrace.recorder.graphs`).
        Returns the module that was entered as the root.
        """
        inner, compiled = unwrap(root)
        hooked = root if compiled else inner
        if root is not inner:  # a DDP wrapper says how the ranks share the batch
            self._wrappers.append(weakref.ref(root))
        written = self._names.add_root(root_name, hooked, prefixed=prefixed)
        self._writer.add_modules(self._module_rows(root_name, written))
        return hooked

    def _restructure(self, root: nn.Module) -> None:
        """Name what was assigned to ``root`` since its last step (:meth:`Names.restructure`)."""
        named = self._names.restructure(root)
        if named is not None:
            self._compiled.renamed()  # graphs' modules found by name are found again
            root_name, written = named
            self._writer.add_modules(self._module_rows(root_name, written))

    def _module_rows(self, root_name: str, modules: dict[str, nn.Module]) -> list[dict[str, Any]]:
        return self._names.rows(root_name, modules, first_step=self.current_step)

    # -- the end, and faults -----------------------------------------------------------------

    def _orphan(self) -> None:
        """In a forked child: hooks return at once, nothing is written, nothing is closed."""
        self._active = False
        self._recording = False
        self._closed = True
        self._detach()  # the child's copies: its modules run without them

    def _detach(self) -> None:
        """Remove every hook and patch, and empty the table: torch is as it was."""
        graphs.receive(None)
        self._compiled.kept.clear()  # gradients a graph handed on, none recorded since
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._calls.remove()
        self._table.clear()
        self._patches.undo()

    def _fault(self, exc: BaseException, where: str) -> None:
        message = fault_message(exc, where, self.current_step)
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

    def _layout(self) -> dict[str, Any]:
        wrappers = [w for w in (ref() for ref in self._wrappers) if w is not None]
        return _data_parallel([*wrappers, *self.roots.values()])

    def _end_step(self, *, skipped: bool = False) -> None:
        # where the ranks sit among the data-parallel ranks, for the final status: told by
        # the DDP wrapper or FSDP2's state, which may be gone when the recording closes
        if not self._place and self._place_tries < 3 and self._recording:
            self._place_tries += 1
            self._place = self._layout()
        super()._end_step(skipped=skipped)

    # -- what tests look at ------------------------------------------------------------------

    @property
    def _tensor_handles(self) -> list[Any]:
        return self._calls.handles

    @property
    def _scratch(self) -> torch.Tensor:
        return self._observer.scratch


def _data_parallel(models: list[nn.Module]) -> dict[str, Any]:
    """The final status's ``data_parallel`` (docs/FORMAT.md), where it can be told."""
    try:
        place = data_parallel(models)
    except Exception:  # a torch of other private names: the analyzer judges from the records
        return {}
    return {} if place is None else {"data_parallel": place}


_GRAPH_KINDS = frozenset({"input", "output", "grad_output"})
"""The kinds of record a compiled graph makes (the others are made outside it)."""


def _unopened_note(paths: list[str]) -> str:
    """What is left out where modules run inside regions of compiled graphs the recorder
    does not open (``paths`` from their compiled frames; the first ten named)."""
    named = ", ".join(repr(p) for p in paths[:10])
    more = f" and {len(paths) - 10} more" if len(paths) > 10 else ""
    runs, their = (
        ("runs in a region", "its outputs and their")
        if len(paths) == 1
        else ("run in regions", "their outputs and")
    )
    return (
        f"inside a compiled graph, {named}{more} {runs} that the recorder does not open "
        "(torch.cond's branches, while_loop's body, a nested compile region, a DTensor's "
        f"local tensor inside activation checkpointing): {their} gradients are not "
        "recorded there (activation checkpointing's regions are)"
    )


def _dtensor_note(paths: list[str]) -> str:
    """What is left out where modules return DTensors of dynamic shapes inside compiled
    graphs (``paths`` from their compiled frames; the first ten named)."""
    named = ", ".join(repr(p) for p in paths[:10])
    more = f" and {len(paths) - 10} more" if len(paths) > 10 else ""
    what = (
        f"output of {named} is a DTensor"
        if len(paths) == 1
        else f"outputs of {named}{more} are DTensors"
    )
    return (
        f"inside a compiled graph, the {what} of a dynamic shape (tensor parallelism's): "
        "where its shard lies is not known when the graph is compiled, so neither it nor its "
        "gradient is recorded there; compile with static shapes to record them"
    )


def _route_taken() -> dict[str, Any] | None:
    """How this process summarised CPU tensors, for the final status (None: none were)."""
    taken = route_taken()
    if taken is None:
        return None
    return {"stats_route": taken.description, "stats_warmup_seconds": round(taken.warmup_s, 3)}
