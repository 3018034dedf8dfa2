"""Each test starts from one torch seed (tests/conftest.py), whatever ran before it in its
process: pytest-xdist hands tests to workers in no fixed order."""

from __future__ import annotations

import torch

FIRST = torch.Generator().manual_seed(0)


def test_a_test_that_draws() -> None:
    assert torch.equal(torch.randn(4), torch.randn(4, generator=FIRST.manual_seed(0)))
    torch.randn(1000)  # leaves the global generator elsewhere


def test_the_next_test_starts_where_the_first_did() -> None:
    assert torch.equal(torch.randn(4), torch.randn(4, generator=FIRST.manual_seed(0)))
