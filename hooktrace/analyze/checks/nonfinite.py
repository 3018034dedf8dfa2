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

from hooktrace.analyze.findings import Finding, strings

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
    culprit: str  # the module whose forward or backward made it
    module: str  # the record's
    kind: str
    slot: str
    nan: int
    inf: int
    numel: int
    after: int  # non-finite records of the same pass after it in the step
    fed_by: tuple[str, str, str] | None  # module, kind, slot


@dataclass(frozen=True)
class _Rows:
    """The columns of one chunk that the search needs, as numpy arrays."""

    rank_step: np.ndarray
    passes: np.ndarray
    bad: np.ndarray
    nan: np.ndarray
    inf: np.ndarray
    module: np.ndarray
    kind: np.ndarray
    slot: np.ndarray
    micro_step: np.ndarray
    numel: np.ndarray


class NonFinite:
    """Non-finite origins over the chunks given to :meth:`add`, then :meth:`findings`.

    ``parent`` and ``root`` (module name -> name, from the modules table) tell which modules
    contain which: a container's grad_output is its last child's, so it never "feeds" one.
    """

    def __init__(self, parent: dict[str, str], root: dict[str, str]) -> None:
        self.parent = parent
        self.root = root
        self.origins: list[Origin] = []
        self.recorded: dict[int, list[int]] = {}  # rank -> its recorded steps, in order

    def add(self, frame: pd.DataFrame) -> None:
        """One chunk: every record of some whole steps, in (rank, step, seq) order: its steps
        are recorded (:meth:`add_steps`) and searched (:meth:`search`)."""
        if frame.empty:
            return
        rank_step = frame["rank"].to_numpy(np.int64) << 40 | frame["step"].to_numpy(np.int64)
        firsts = np.r_[True, rank_step[1:] != rank_step[:-1]]  # in order: one per (rank, step)
        self.add_steps(rank_step[firsts] >> 40, rank_step[firsts] & ((1 << 40) - 1))
        self.search(frame)

    def add_steps(self, rank: np.ndarray, step: np.ndarray) -> None:
        """Recorded steps, in (rank, step) order after those added before: steps in a row with
        the same origin are one finding only where no recorded step lies between them."""
        for r, s in zip(rank.tolist(), step.tolist(), strict=True):
            self.recorded.setdefault(r, []).append(s)

    def search(self, frame: pd.DataFrame) -> None:
        """The origins in every record of some whole steps, in (rank, step, seq) order (steps
        without a NaN or Inf may be left out).

        A step's params, forward and backward are all in its chunk, so the consequences are
        told from the origins here: a forward origin at a module whose parameters were already
        non-finite, and a backward origin at a module whose forward was already non-finite in
        the same micro-step, are not kept."""
        rank_step = frame["rank"].to_numpy(np.int64) << 40 | frame["step"].to_numpy(np.int64)
        nan = frame["nan_count"].fillna(0).to_numpy(np.int64)
        inf = frame["inf_count"].fillna(0).to_numpy(np.int64)
        bad = (nan > 0) | (inf > 0)
        if not bad.any():
            return
        kind = strings(frame["kind"])
        rows = _Rows(
            rank_step, np.array([_PASS.get(k, 0) for k in kind], dtype=np.int64), bad, nan, inf,
            strings(frame["module"]), kind, strings(frame["slot"]),
            frame["micro_step"].to_numpy(np.int64), frame["numel"].to_numpy(np.int64),
        )  # fmt: skip
        # bad records grouped by (rank, step, pass), each group in seq order
        positions = np.flatnonzero(bad)
        group = rank_step[positions] * 4 + rows.passes[positions]
        order = np.argsort(group, kind="stable")
        members_of = positions[order]
        _, starts, counts = np.unique(group[order], return_index=True, return_counts=True)
        bad_params: dict[int, set[str]] = {}  # rank_step -> modules with non-finite params
        bad_forward: dict[int, set[tuple[int, str]]] = {}  # rank_step -> (micro-step, module)
        firsts = []
        for start, count in zip(starts.tolist(), counts.tolist(), strict=True):
            members = members_of[start : start + count]
            first = int(members[0])
            pass_ = int(rows.passes[first])
            if pass_ == 3:
                bad_params.setdefault(int(rank_step[first]), set()).update(rows.module[members])
            elif pass_ == 1:
                bad_forward.setdefault(int(rank_step[first]), set()).update(
                    zip(rows.micro_step[members].tolist(), rows.module[members], strict=True)
                )
            if pass_:
                firsts.append((first, pass_, count - 1))
        for first, pass_, after in firsts:
            rs = int(rank_step[first])
            if pass_ == 1 and rows.module[first] in bad_params.get(rs, ()):
                continue  # its own parameters were non-finite: see nonfinite_param
            fed_by = self._fed_by(rows, int(np.searchsorted(rank_step, rs, side="left")), first)
            culprit = str(rows.module[first])
            if pass_ == 2 and fed_by is not None and rows.kind[first] != "grad_param":
                culprit = fed_by[0]  # the consumer whose backward made the gradient
            micro_step = int(rows.micro_step[first])
            if pass_ == 2 and (micro_step, culprit) in bad_forward.get(rs, ()):
                continue  # its forward was already non-finite: the backward follows from it
            self.origins.append(
                Origin(
                    pass_, rs >> 40, rs & ((1 << 40) - 1), micro_step, culprit,
                    str(rows.module[first]), str(rows.kind[first]), str(rows.slot[first]),
                    int(rows.nan[first]), int(rows.inf[first]), int(rows.numel[first]), after,
                    fed_by,
                )
            )  # fmt: skip

    def _fed_by(self, rows: _Rows, start: int, position: int) -> tuple[str, str, str] | None:
        """The latest finite record of the same pass before ``position`` in its step (which
        begins at ``start``): in the backward pass not one of the origin's containers (their
        grad_output is their last child's), and for a grad_param preferably its own module's
        grad_output."""
        window = slice(start, position)
        same = (rows.passes[window] == rows.passes[position]) & ~rows.bad[window]
        candidates = np.flatnonzero(same)[::-1] + start
        if rows.passes[position] == 2:
            skip = self._ancestors(str(rows.module[position]))
            candidates = candidates[~np.isin(rows.module[candidates], list(skip))]
            if rows.kind[position] == "grad_param":
                own = candidates[rows.module[candidates] == rows.module[position]]
                candidates = own if len(own) else candidates
        if not len(candidates):
            return None
        at = int(candidates[0])
        return str(rows.module[at]), str(rows.kind[at]), str(rows.slot[at])

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
        """The origins as findings; steps in a row with the same origin are one."""
        following = {
            (rank, a): b for rank, steps in self.recorded.items() for a, b in pairwise(steps)
        }
        return [_nonfinite_finding(run) for run in _runs(self.origins, following)]


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
    module, slot = o.culprit, o.slot if o.culprit == o.module else ""
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
        elif o.culprit != o.module:
            explanation = f"the backward of {module} turned a finite gradient into {what}; it first shows at {o.module}'s {o.kind}"
        else:
            explanation = f"the backward of {o.module} made {what} in its {o.kind} from a finite gradient at its output"
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
