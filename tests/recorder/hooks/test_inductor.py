"""A model compiled with torch.compile's default backend (inductor), as the best-known GPT
training scripts compile theirs: its forward returns ``(logits, loss)``, so the logits leave
the compiled graph with no gradient from outside it (the loss was computed inside it). The
graph's backward handed a hook on them ``None``, which once stopped the recording at step 0
with an empty trace; and the gradient the loss gives them, which an eager run records as the
root's, was not recorded at all, until it was taken inside the graph. Compiled once per run
below, and run eagerly once to compare; the model is tiny."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import hooktrace


class GPTLike(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.fc = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32)

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.head(torch.relu(self.fc(self.emb(idx))))
        loss = None
        if targets is not None:
            loss = nn.functional.cross_entropy(logits.view(-1, 32), targets.view(-1))
        return logits, loss


def _train(
    out: Path | None, *, compiled: bool = True
) -> tuple[list[float], dict[str, torch.Tensor], int | None]:
    """Three AdamW steps of a freshly seeded, inductor-compiled model (eager where not
    ``compiled``), recorded into ``out`` where given: the losses, the final parameters and
    the recording's error (None: none)."""
    torch._dynamo.reset()  # each run compiles its own graphs: the recorded one instrumented
    torch.manual_seed(0)
    model = GPTLike()
    run = torch.compile(model) if compiled else model  # inductor, the default
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 32, (4, 8), generator=data), torch.randint(0, 32, (4, 8), generator=data))
        for _ in range(3)
    ]

    def steps() -> list[float]:
        losses = []
        for idx, targets in batches:
            _, loss = run(idx, targets)
            assert loss is not None
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    if out is None:
        return steps(), {k: v.detach().clone() for k, v in model.state_dict().items()}, None
    with hooktrace.record(run, out) as rec:
        losses = steps()
        error = rec.error
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, error


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("inductor") / "run"
    plain = _train(None)
    recorded = _train(out)
    _train(out.with_name("eager"), compiled=False)
    return {"plain": plain, "recorded": recorded, "out": out, "eager": out.with_name("eager")}


def test_a_model_compiled_by_inductor_is_recorded_every_step(runs: dict[str, object]) -> None:
    _, _, error = runs["recorded"]  # type: ignore[misc]
    assert error is None
    trace = hooktrace.load(runs["out"])  # type: ignore[arg-type]
    assert hooktrace.check(trace).whole
    records = trace.records
    assert sorted(records["step"].unique()) == [0, 1, 2]
    step = records[records["step"] == 1]
    root = step[step["module"] == "GPTLike"]
    assert list(root.loc[root["kind"] == "output", "slot"]) == ["0", "1"]  # logits, loss
    # the loss's gradient is 1, then the logits', which the loss gives them inside the graph
    grads = root[root["kind"] == "grad_output"]
    assert list(grads["slot"]) == ["1", "0"]
    assert grads["mean"].iloc[0] == 1.0
    # the modules inside the graph, recorded from the statistics compiled into it
    inside = step[step["module"] != "GPTLike"]
    assert list(inside.loc[inside["kind"] == "output", "module"]) == ["emb", "fc", "head"]
    assert list(inside.loc[inside["kind"] == "grad_output", "module"]) == ["head", "fc", "emb"]
    assert (
        len(step[step["kind"] == "param"]) == len(step[step["kind"] == "grad_param"]) == 3 * 2 - 1
    )


def test_recording_an_inductor_compiled_model_leaves_its_training_bit_identical(
    runs: dict[str, object],
) -> None:
    losses, params, _ = runs["plain"]  # type: ignore[misc]
    recorded_losses, recorded_params, _ = runs["recorded"]  # type: ignore[misc]
    assert recorded_losses == losses
    for name, value in params.items():
        assert torch.equal(recorded_params[name], value), name


def test_the_roots_output_that_its_loss_reads_has_the_gradient_an_eager_run_records(
    runs: dict[str, object],
) -> None:
    """The logits' gradient reaches them inside the graph, from the loss: taken there, at the
    tap on the head's output they are, it is recorded as the root's too, as an eager run
    records it (a hook on the logits the graph returns sees no gradient)."""
    compiled = hooktrace.load(runs["out"]).records  # type: ignore[arg-type]
    eager = hooktrace.load(runs["eager"]).records  # type: ignore[arg-type]
    columns = ["step", "micro_step", "phase", "module", "call", "kind", "slot"]
    grads = [r[r["kind"] == "grad_output"] for r in (compiled, eager)]
    assert grads[0][columns].values.tolist() == grads[1][columns].values.tolist()
    root = grads[0][(grads[0]["module"] == "GPTLike") & (grads[0]["slot"] == "0")]
    assert list(root["step"]) == [0, 1, 2]
    result = hooktrace.diff(runs["eager"], runs["out"], rtol=1e-4)  # type: ignore[arg-type]
    assert result.match, result
    assert result.records == len(eager)
