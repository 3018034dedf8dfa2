"""A model compiled with torch.compile's default backend (inductor), as the best-known GPT
training scripts compile theirs: its forward returns ``(logits, loss)``, so the logits leave
the compiled graph with no gradient (the loss was computed inside it), and the graph's
backward hands their hook ``None``. That once stopped the recording at step 0 with an empty
trace. Compiled once per run below; the model is tiny."""

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


def _train(out: Path | None) -> tuple[list[float], dict[str, torch.Tensor], int | None]:
    """Three AdamW steps of a freshly seeded, inductor-compiled model, recorded into ``out``
    where given: the losses, the final parameters and the recording's error (None: none)."""
    torch._dynamo.reset()  # each run compiles its own graphs: the recorded one instrumented
    torch.manual_seed(0)
    model = GPTLike()
    compiled = torch.compile(model)  # inductor, the default
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = torch.Generator().manual_seed(1)
    batches = [
        (torch.randint(0, 32, (4, 8), generator=data), torch.randint(0, 32, (4, 8), generator=data))
        for _ in range(3)
    ]

    def steps() -> list[float]:
        losses = []
        for idx, targets in batches:
            _, loss = compiled(idx, targets)
            assert loss is not None
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    if out is None:
        return steps(), {k: v.detach().clone() for k, v in model.state_dict().items()}, None
    with hooktrace.record(compiled, out) as rec:
        losses = steps()
        error = rec.error
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, error


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    out = tmp_path_factory.mktemp("inductor") / "run"
    plain = _train(None)
    recorded = _train(out)
    return {"plain": plain, "recorded": recorded, "out": out}


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
    # the loss's gradient is 1; the logits', computed inside the graph, never leaves it
    grads = root[root["kind"] == "grad_output"]
    assert list(grads["slot"]) == ["1"]
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
