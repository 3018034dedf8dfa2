"""Where the first NaN or Inf came from: the non-finite check of :func:`hooktrace.anomalies`
(its module docstring has the definitions). Never imports torch.

Records come in chunks of whole steps, each sorted by (rank, step, seq): execution order.
Per step and pass only the first non-finite record is kept (an :class:`Origin`), with the
latest finite record of the same pass before it, so what is held stays small.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

import numpy as np
import pandas as pd

from hooktrace.analyze.findings import Finding, keys

FORWARD_KINDS = ("input", "output", "tensor")
BACKWARD_KINDS = ("grad_output", "grad_tensor", "grad_param")
_PASS = {**dict.fromkeys(FORWARD_KINDS, 1), **dict.fromkeys(BACKWARD_KINDS, 2), "param": 3}


@dataclass(frozen=True)
class Origin:
    """The first non-finite record of one pass (1 forward, 2 backward, 3 param) in a step."""

    pass_: int
    rank: int
    step: int
    micro_step: int
    module: str
    kind: str
    slot: str
    nan: int
    inf: int
    numel: int
    after: int  # non-finite records of the same pass after it in the step
    fed_by: tuple[str, str, str] | None  # module, kind, slot


class NonFinite:
    """Non-finite origins over the chunks given to :meth:`add`, then :meth:`findings`.

    ``parent`` and ``root`` (module name -> name, from the modules table) tell which modules
    contain which: a container's grad_output is its last child's, so it never "feeds" one.
    """

    def __init__(self, parent: dict[str, str], root: dict[str, str]) -> None:
        self.parent = parent
        self.root = root
        self.origins: list[Origin] = []
        self.bad_params: set[tuple[int, int, str]] = set()  # (rank, step, module)
        self.bad_forward: set[tuple[int, int, int]] = set()  # (rank, step, micro_step)
        self.recorded: dict[int, list[int]] = {}  # rank -> its recorded steps, in order

    def add(self, frame: pd.DataFrame, kind: pd.Series) -> None:
        """One chunk: every record of some whole steps, in (rank, step, seq) order."""
        for rank, steps in frame.groupby("rank")["step"]:
            self.recorded.setdefault(int(keys(rank)[0]), []).extend(int(s) for s in steps.unique())
        bad = (frame["nan_count"].fillna(0) > 0) | (frame["inf_count"].fillna(0) > 0)
        if not bad.any():
            return
        passes = kind.map(_PASS).fillna(0).to_numpy(dtype=np.int64)
        bad_np = bad.to_numpy()
        rank_step = frame["rank"].to_numpy(dtype=np.int64) << 40 | frame["step"].to_numpy(np.int64)
        module = frame["module"].astype(str).to_numpy()
        rows = frame.assign(pass_=passes, position=np.arange(len(frame)))[bad_np]
        for key, group in rows.groupby(["rank", "step", "pass_"], sort=True):
            rank, step, pass_ = keys(key)
            first = group.iloc[0]
            position = int(first["position"])
            if pass_ == 3:
                self.bad_params.update(
                    (int(rank), int(step), str(m)) for m in group["module"].astype(str)
                )
            if pass_ == 1:
                self.bad_forward.update((int(rank), int(step), int(m)) for m in group["micro_step"])
            start = int(np.searchsorted(rank_step, rank_step[position], side="left"))
            fed_by = self._fed_by(
                frame, module, passes, bad_np, start, position, str(first["kind"])
            )
            self.origins.append(
                Origin(
                    int(pass_),
                    int(rank),
                    int(step),
                    int(first["micro_step"]),
                    str(module[position]),
                    str(first["kind"]),
                    str(first["slot"]),
                    int(first["nan_count"]),
                    int(first["inf_count"]),
                    int(first["numel"]),
                    len(group) - 1,
                    fed_by,
                )
            )

    def _fed_by(
        self, frame: pd.DataFrame, module: np.ndarray, passes: np.ndarray, bad: np.ndarray,
        start: int, position: int, kind: str,
    ) -> tuple[str, str, str] | None:  # fmt: skip
        """The latest finite record of the same pass before ``position`` in its step: in the
        backward pass not one of the origin's containers (their grad_output is their last
        child's), and for a grad_param preferably its own module's grad_output."""
        candidates = np.flatnonzero(
            (passes[start:position] == passes[position]) & ~bad[start:position]
        )
        candidates = candidates[::-1] + start
        if passes[position] == 2:
            skip = self._ancestors(str(module[position]))
            candidates = candidates[~np.isin(module[candidates], list(skip))]
            if kind == "grad_param":
                own = candidates[module[candidates] == module[position]]
                candidates = own if len(own) else candidates
        if not len(candidates):
            return None
        row = frame.iloc[int(candidates[0])]
        return str(row["module"]), str(row["kind"]), str(row["slot"])

    def _ancestors(self, name: str) -> set[str]:
        found = set()
        parent = self.parent.get(name, "")
        while parent and parent not in found:
            found.add(parent)
            parent = self.parent.get(parent, "")
        root = self.root.get(name, "")
        if root and root != name:
            found.add(root)
        return found

    def findings(self) -> list[Finding]:
        origins = [
            o for o in self.origins
            if not (o.pass_ == 1 and (o.rank, o.step, o.module) in self.bad_params)
            and not (o.pass_ == 2 and o.fed_by is None
                     and (o.rank, o.step, o.micro_step) in self.bad_forward)
        ]  # fmt: skip
        following = {
            (rank, a): b for rank, steps in self.recorded.items() for a, b in pairwise(steps)
        }
        return [_nonfinite_finding(run) for run in _runs(origins, following)]


def _runs(origins: list[Origin], following: dict[tuple[int, int], int]) -> list[list[Origin]]:
    """Origins of one pass and rank, in step order, merged while the origin stays the same
    and each is at the recorded step right after the last (``following``)."""
    runs: list[list[Origin]] = []
    for o in sorted(origins, key=lambda o: (o.pass_, o.rank, o.step)):
        last = runs[-1][-1] if runs else None
        if (
            last is not None
            and (last.pass_, last.rank, last.module, last.kind, last.slot)
            == (o.pass_, o.rank, o.module, o.kind, o.slot)
            and following.get((o.rank, last.step)) == o.step
        ):
            runs[-1].append(o)
        else:
            runs.append([o])
    return runs


def _nonfinite_finding(run: list[Origin]) -> Finding:
    o, last = run[0], run[-1]
    what = " and ".join(w for w, n in (("NaN", o.nan), ("Inf", o.inf)) if n) or "NaN"
    record = f"{o.module} {o.kind} {o.slot}"
    fed = " ".join(o.fed_by) if o.fed_by else None
    evidence = f"{record}: {o.nan} NaN, {o.inf} Inf of {o.numel} values"
    evidence += f"; after {fed} (finite)" if fed else ""
    evidence += f"; {o.after} non-finite record(s) followed in step {o.step}" if o.after else ""
    evidence += (
        f"; the same at every step to {last.step} ({len(run)} steps)" if len(run) > 1 else ""
    )
    module, slot = o.module, o.slot
    if o.pass_ == 1:
        kind = "nonfinite_forward"
        if o.kind == "input":
            explanation = f"the input of {o.module} was already {what}: code before it ({'after ' + fed if fed else 'outside the recorded modules'}) made it"
        else:
            explanation = f"{o.module} produced the first {what} of the forward pass; what follows downstream comes from it"
    elif o.pass_ == 2:
        kind = "nonfinite_backward"
        if o.fed_by is None:
            explanation = f"the gradient was {what} from the start of the backward pass: the loss, or code after the model, made it"
        elif o.kind != "grad_param" and o.fed_by[1] in ("grad_output", "grad_tensor"):
            module, slot = o.fed_by[0], ""
            explanation = f"the backward of {module} turned a finite gradient into {what}; it first shows at {o.module}'s {o.kind}"
        else:
            explanation = f"the backward of {o.module} made {what} in its parameter gradient from a finite gradient at its output"
    else:
        kind = "nonfinite_param"
        explanation = (
            f"the parameter was already {what} when step {o.step} began: an earlier update wrote it"
        )
    return Finding(
        kind, "error", module, o.step, evidence, explanation, slot=slot, rank=o.rank,
        last_step=last.step, micro_step=o.micro_step, value=float(o.nan + o.inf),
        count=len(run),
    )  # fmt: skip
