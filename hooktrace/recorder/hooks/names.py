"""Roots and names: which modules a recording holds, and the name each is recorded under.

A root is a model given to the recorder (or found by :mod:`hooktrace.recorder.recording.discover`).
Its modules are named as ``named_modules()`` names them, wrappers looked through, and
entered in the :class:`~hooktrace.recorder.hooks.attach.ModuleTable` that the process-wide hooks
consult; their parameters and buffers become the entries :mod:`hooktrace.recorder.records.params`
records. A root's structure may change while it trains (a head replaced, a layer wrapped):
:meth:`Names.restructure` names what is new.

Apart from the recorder because naming is a question of the model alone: it holds no
step and no tensor, and it never runs inside a hook's per-tensor work.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from hooktrace.errors import ConfigError
from hooktrace.recorder.hooks.attach import ModuleTable
from hooktrace.recorder.records.params import Entry, RecordsCache

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


class Names:
    """The roots, their recorded modules by name, and the parameter and buffer entries.

    ``include``, ``skip`` and ``full`` are the module filters (:mod:`hooktrace.recorder.hooks.select`):
    recorded, left out, saved whole on a full step.
    """

    def __init__(
        self,
        table: ModuleTable,
        *,
        include: Callable[[str], bool],
        skip: Callable[[str], bool],
        full: Callable[[str], bool],
    ) -> None:
        self._table = table
        self._include = include
        self._skip = skip
        self._full_match = full
        self.roots: dict[str, nn.Module] = {}
        self.modules: dict[str, nn.Module] = {}
        self.full_modules: set[str] = set()
        self.param_entries: list[Entry] = []
        self.buffer_entries: list[Entry] = []
        self.param_records = RecordsCache()
        self.param_ids: set[int] = set()  # every parameter of a recorded root
        self._entered: set[int] = set()  # parameters and buffers with a record of their own
        self.known: set[int] = set()  # ids of modules already named, or looked for
        self._prefixed: dict[str, bool] = {}  # by root: its modules' names carry its name
        self._root_names: dict[int, str] = {}  # by id of the module entered as a root
        self._where: dict[int, tuple[str, str]] = {}  # by module id: (root, qualname)
        self._layouts_seen: dict[int, list[int]] = {}  # by root id: its modules' ids

    def add_root(
        self, root_name: str, hooked: nn.Module, *, prefixed: bool
    ) -> dict[str, nn.Module]:
        """Name a root model's modules and parameters, and enter the modules selected in the
        table. Modules already named (shared with an earlier root) keep their first name.
        ``hooked`` is the module entered as the root: a compiled model's wrapper, whose
        modules are named as the model's own (their records come from the compiled graphs,
        :mod:`hooktrace.recorder.graphs`). Returns the modules newly named."""
        self.roots[root_name] = hooked
        self._prefixed[root_name] = prefixed
        self._root_names[id(hooked)] = root_name
        self._table.add_root(hooked)
        return self._add_modules(root_name, hooked, prefixed=prefixed)

    def every_name(self) -> list[str]:
        """Every module's name as the filters saw it, selected or not, roots first."""
        return [_qualified(r, q, self._prefixed[r]) for r, q in self._where.values()]

    def _add_modules(
        self, root_name: str, root: nn.Module, *, prefixed: bool
    ) -> dict[str, nn.Module]:
        """Name ``root``'s modules not named yet (a module shared with an earlier root keeps
        its first name), with their parameters and buffers, and enter the selected ones in
        the table."""
        new: dict[str, nn.Module] = {}
        inner, _ = unwrap(root)
        if inner is not root:  # a compiled model: its wrapper stands for it
            self.known.add(id(inner))
        named = [("", root)] + [(q, m) for q, m in inner.named_modules() if q]
        for qualname, module in named:
            if id(module) in self.known:
                continue
            self.known.add(id(module))
            self._where[id(module)] = (root_name, qualname)
            name = _qualified(root_name, qualname, prefixed)
            if self._include(name) and not self._skip(name):
                new[name] = module
        written = [name for name in new if name not in self.modules]
        self.modules.update(new)
        self.full_modules.update(name for name in new if self._full_match(name))
        params, buffers = [], []
        for qualname, param in inner.named_parameters():
            if id(param) in self._entered:
                continue
            self.param_ids.add(id(param))  # an optimizer holding it trains a recorded model
            entry = _entry(root_name, inner, qualname, prefixed=prefixed)
            if entry.module in new:
                self._entered.add(id(param))
                params.append(entry)
        for qualname, buffer in inner.named_buffers():
            if id(buffer) in self._entered:
                continue
            entry = _entry(root_name, inner, qualname, prefixed=prefixed)
            if entry.module in new:
                self._entered.add(id(buffer))
                buffers.append(entry)
        self.param_entries = _replaced(self.param_entries, params, set(new))
        self.buffer_entries = _replaced(self.buffer_entries, buffers, set(new))
        self.param_records = RecordsCache()  # built for the entries as they were
        for name, module in new.items():
            self._table.add(module, name, channels_first=isinstance(module, _CHANNELS_FIRST))
        return {n: new[n] for n in written}

    def restructure(self, root: nn.Module) -> tuple[str, dict[str, nn.Module]] | None:
        """Name the modules assigned to ``root`` since it was last looked at (``model.head =
        nn.Linear(...)``, a module added, or one wrapped: ``m.fc = LoRA(m.fc)``), and enter
        them: checked at each step's first forward of the root, by the identity of its
        modules, so they are recorded from that step on. A module that moved within the
        root is renamed; the parameter records under a name changed are the new module's.
        Returns the root's name and the modules named for the first time, or None where
        nothing was named."""
        root_name = self._root_names.get(id(root))
        if root_name is None:
            return None
        inner, compiled = unwrap(root)
        if compiled:
            return None
        layout = _layout(inner)
        if layout == self._layouts_seen.get(id(root)):
            return None
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
            self.known.add(id(module))
            name = _qualified(root_name, qualname, prefixed)
            if self._include(name) and not self._skip(name):
                fresh[name] = module
        if not fresh:
            return None
        written = {n: m for n, m in fresh.items() if n not in self.modules}
        self.modules.update(fresh)
        self.full_modules.update(name for name in fresh if self._full_match(name))
        params, buffers = [], []
        for name, module in fresh.items():
            for attr, param in module.named_parameters(recurse=False):
                self.param_ids.add(id(param))
                self._entered.add(id(param))
                params.append(Entry.of(name, attr, module, attr))
            for attr, buffer in module.named_buffers(recurse=False):
                self._entered.add(id(buffer))
                buffers.append(Entry.of(name, attr, module, attr))
        self.param_entries = _replaced(self.param_entries, params, set(fresh))
        self.buffer_entries = _replaced(self.buffer_entries, buffers, set(fresh))
        self.param_records = RecordsCache()  # built for the entries as they were
        for name, module in fresh.items():
            self._table.name(module, name, channels_first=isinstance(module, _CHANNELS_FIRST))
        return root_name, written

    def wants_full(self, name: str) -> bool:
        """Whether ``name`` (a module, or a watched tensor's name) is saved whole on a full
        step."""
        if name in self.modules:
            return name in self.full_modules
        return bool(self._full_match(name))

    def root_of(self, module: nn.Module) -> nn.Module | None:
        """The root ``module`` was named under (of a module two roots share, the first)."""
        where = self._where.get(id(module))
        return self.roots.get(where[0]) if where is not None else None

    def locate(self, name: str) -> tuple[nn.Module, str] | None:
        """A recorded module by its trace name, and its qualified name inside its root."""
        module = self.modules.get(name)
        where = self._where.get(id(module)) if module is not None else None
        return (module, where[1]) if module is not None and where is not None else None

    def all_parameters(self) -> list[torch.Tensor]:
        return [p for root in self.roots.values() for p in root.parameters()]

    def rows(
        self, root_name: str, modules: dict[str, nn.Module], *, first_step: int
    ) -> list[dict[str, Any]]:
        """The modules table's rows (docs/FORMAT.md) of ``modules``, named from ``first_step``."""
        rows = []
        for name, module in modules.items():
            parent = name.rpartition(".")[0]
            rows.append(
                {
                    "module": name,
                    "type": f"{user_class(module).__module__}.{user_class(module).__qualname__}",
                    "root": root_name,
                    "parent": parent
                    if parent in self.modules
                    else ("" if name == root_name else root_name),
                    "depth": 0
                    if name == root_name
                    else name.count(".") + (0 if name.startswith(root_name + ".") else 1),
                    "parameters": _parameter_count(module),
                    "first_step": first_step,
                }
            )
        return rows


def name_roots(models: Models) -> dict[str, nn.Module]:
    """Root names: a lone model is named by its class; several are named by key or class.
    Raises :class:`ConfigError` for anything else (before a model is looked into)."""
    if isinstance(models, nn.Module):
        return {user_class(unwrap(models)[0]).__name__: models}
    if isinstance(models, Mapping):
        roots = dict(models)
        if not all(isinstance(name, str) and name for name in roots):
            raise ConfigError(
                f"record() names the models of a dict by its keys, which must be non-empty "
                f"strings (got {sorted(map(repr, roots))})"
            )
    elif isinstance(models, (str, bytes)) or not isinstance(models, Iterable):
        raise _not_models(f"not {type(models).__name__}")
    else:
        roots = {}
        for model in models:
            if not isinstance(model, nn.Module):
                raise _not_models(f"not {type(model).__name__}")
            base = user_class(unwrap(model)[0]).__name__
            name, n = base, 1
            while name in roots:
                name, n = f"{base}#{n}", n + 1
            roots[name] = model
    wrong = next((m for m in roots.values() if not isinstance(m, nn.Module)), None)
    if wrong is not None:
        raise _not_models(f"not {type(wrong).__name__}")
    if not roots:
        raise _not_models("not an empty one")
    return roots


def _not_models(got: str) -> ConfigError:
    return ConfigError(
        f"record() takes an nn.Module, a dict of them by name, or a list of them, {got}"
    )


def user_class(module: nn.Module) -> type:
    """The class the script made ``module`` of: FSDP2's ``fully_shard`` swaps a module's class
    for ``FSDP<Class>`` (bases FSDPModule and the class), so that a sharded run's model is
    named, and its types listed, as the same model trained in one process."""
    cls = type(module)
    bases = cls.__bases__
    if (
        len(bases) == 2
        and bases[0].__name__ == "FSDPModule"
        and cls.__name__ == f"FSDP{bases[1].__name__}"
    ):
        return bases[1]
    return cls


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


def _parameter_count(module: nn.Module) -> int:
    """Values in ``module``'s parameters; a lazy module's count none until its first call."""
    from torch.nn.parameter import UninitializedTensorMixin as lazy  # type: ignore[attr-defined]

    return sum(p.numel() for p in module.parameters() if not isinstance(p, lazy))


def _entry(root_name: str, inner: nn.Module, qualname: str, *, prefixed: bool) -> Entry:
    """A parameter or buffer of ``inner`` (a root) by its qualified name, under its module."""
    owner, _, attr = qualname.rpartition(".")
    found = inner.get_submodule(owner)
    return Entry.of(_qualified(root_name, owner, prefixed), attr, found, attr)


def _qualified(root_name: str, qualname: str, prefixed: bool) -> str:
    """A module's name: the root's name for the root itself; its qualified name inside a
    lone model; ``root.qualname`` when several models are recorded."""
    if not qualname:
        return root_name
    return f"{root_name}.{qualname}" if prefixed else qualname


def _layout(root: nn.Module) -> list[int]:
    """The ids of ``root``'s modules in the order ``root.modules()`` gives them (each once),
    walked without its nested generators, which took six times as long on a model of 200
    layers: this runs at every step's first forward."""
    ids: list[int] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        module = stack.pop()
        key = id(module)
        if key in seen:
            continue
        seen.add(key)
        ids.append(key)
        children = module._modules
        if children:
            stack.extend([child for child in reversed(children.values()) if child is not None])
    return ids
