"""The recorder's joint graph pass: what inductor compiles of a recorded graph keeps for the
backward, and the order it draws random numbers in, as for the graph unrecorded.

While inductor compiles a graph the recorder instrumented, AOTAutograd's joint graph (forward
and backward together, before they are split) goes through one more pass, chained after any
joint pass the script set:

- :func:`~hooktrace.recorder.graphs.masks.tag_masks`: the forward keeps for the backward what
  it keeps unrecorded (summarised values and their masks made again in the backward);
- :func:`~hooktrace.recorder.graphs.draws.keep_draw_order`: a forward that draws random
  numbers twice or more draws them in the graph's order (the order of the graph unrecorded
  before inductor's scheduler).

Inductor's caches key the compiled graphs by the pass's source files. A torch whose inductor
cannot chain joint passes (``get_custom_graph_passes``, torch 2.13) gets the pass only where
the script set none.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import fx

from hooktrace.recorder.graphs.draws import keep_draw_order
from hooktrace.recorder.graphs.masks import tag_masks


@contextlib.contextmanager
def joint_pass() -> Iterator[None]:
    """While inductor compiles a graph in here, its joint graph goes through the recorder's
    pass, after the script's; nothing changes where this torch cannot run it
    (:func:`joint_pass_available`)."""
    passes = _passes()
    if passes is None:
        yield
        return
    from torch._inductor import config

    patch: dict[str, Any] = {"joint_custom_post_pass": passes}
    if hasattr(config, "reorder_for_peak_memory"):  # the pass may switch it off: put it back
        patch["reorder_for_peak_memory"] = config.reorder_for_peak_memory
    with config.patch(patch):
        yield


def joint_pass_available() -> bool:
    """Whether :func:`joint_pass` runs the recorder's pass in this torch, with the joint pass
    the script has set now."""
    return _passes() is not None


def _passes() -> Any:
    """What ``joint_custom_post_pass`` is set to while the recorder compiles: the script's
    passes and then the recorder's; None where this torch cannot have both."""
    ours = _pass()
    if ours is None:
        return None
    from torch._inductor import config

    theirs = config.joint_custom_post_pass
    try:
        from torch._inductor.custom_graph_pass import get_custom_graph_passes
    except ImportError:  # one pass only: ours where the script set none
        return ours if theirs is None else None
    return (*get_custom_graph_passes(theirs), ours)


@functools.cache
def _pass() -> Any:
    """The joint graph pass, or None where this torch's inductor has no joint graph pass, or
    none its caches can key."""
    try:
        from torch._inductor import config
        from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
    except ImportError:
        return None
    if not hasattr(config, "joint_custom_post_pass"):
        return None
    here = Path(__file__).parent
    sources = tuple(str(here / name) for name in ("joint.py", "masks.py", "draws.py"))

    class AsUnrecorded(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            tag_masks(graph)
            keep_draw_order(graph)

        def uuid(self) -> bytes:  # inductor's caches key the graphs by it
            return get_hash_for_files(sources)

    return AsUnrecorded()
