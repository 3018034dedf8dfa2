"""The GPU route's Triton kernels (hooktrace/recorder/stats/device_kernels.py), run by Triton's
interpreter on the CPU: a machine without a GPU checks the kernels' arithmetic, not their
speed. Each case runs in a child process, where ``TRITON_INTERPRET=1`` is set before Triton
defines a kernel; the kernels' rows are checked against values worked out by hand
(REFERENCE_CASES.md, case 1) and against torch's route, which they replace on a device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from hooktrace.recorder.stats import device_kernels
from hooktrace.trace.histograms import EXPONENT_MIN, NEG, POS

pytest.importorskip("triton", reason="Triton runs the GPU route's kernels (the dev extra)")

_CHILD = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    import torch
    from hooktrace.recorder.stats import device_kernels
    from hooktrace.recorder.stats.torch_route import histogram_torch, summarize_on_device

    g = torch.Generator().manual_seed(0)
    cases = {
        "fc1": torch.tensor([[7.0, -13.0, 27.0, -29.0]]),
        "relu1": torch.tensor([[7.0, 0.0, 27.0, 0.0]]),
        "blocks": torch.randn(5000, 3, generator=g) * 3 + 1,  # 8 blocks, the last partial
        "channels_last": torch.relu(torch.randn(4, 8, 9, 9, generator=g)).to(
            memory_format=torch.channels_last
        ),
        "transposed": torch.randn(30, 50, generator=g).t(),
        "nan": torch.tensor([1.0, float("nan"), -2.0, 0.0]),
        "inf": torch.tensor([1.0, float("inf"), -2.0, 0.0, -0.0]),
        "bfloat16": (torch.randn(3000, generator=g) * 1e-3).bfloat16(),
        "float16": (torch.randn(3000, generator=g) * 1e3).half(),
        "subnormal": torch.tensor([1e-40, -3e-45, 1e-30, 5.0, -1e38, 0.0]),
        "float64": torch.randn(100, dtype=torch.float64, generator=g),
    }
    out = {}
    for name, x in cases.items():
        usable = device_kernels.usable(x)
        row = device_kernels.summarize(x).tolist()
        torch_row = summarize_on_device(x.float()).tolist()
        hist = torch_hist = None
        if device_kernels.usable(x, histogram=True):
            hist = device_kernels.histogram(x).tolist()
            torch_hist = np.asarray(histogram_torch(x)).tolist()
        again = device_kernels.summarize(x).tolist()
        flat = device_kernels._flat(x)
        blocks = device_kernels._in_blocks(flat).tolist()  # two launches, whatever its size
        out[name] = dict(usable=usable, row=row, torch_row=torch_row, hist=hist,
                         torch_hist=torch_hist, again=again, blocks=blocks,
                         one_block=flat.numel() <= device_kernels.BLOCK)
    # blocks of 16 values, partial results read 4 at a time: the combining program's loops
    # run hundreds of times (a tensor of over 2 million values does at the real sizes)
    device_kernels.BLOCK, device_kernels.PARTS = 16, 4
    for name in ["blocks", "nan", "bfloat16", "transposed"]:
        x = cases[name]
        out[name]["small_blocks"] = device_kernels.summarize(x).tolist()
        out[name]["small_blocks_hist"] = device_kernels.histogram(x).tolist()
    from torch.nn.parameter import UninitializedParameter
    out["rejected"] = [
        device_kernels.usable(x)
        for x in [
            torch.ones(3, dtype=torch.int64),
            torch.ones(0),
            torch.ones(3).to_sparse(),
            UninitializedParameter(),
        ]
    ] + [device_kernels.usable(torch.ones(3, dtype=torch.float64), histogram=True)]
    json.dump(out, sys.stdout)
    """
)


@pytest.fixture(scope="module")
def kernels_run() -> dict[str, dict[str, object]]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "HOOKTRACE_DEVICE_KERNELS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, dict[str, object]] = json.loads(done.stdout)
    return result


def _bin(value: float) -> int:
    """A value's bin, worked out by hand: 2^e <= |value| < 2^(e+1) is bin e - EXPONENT_MIN + 1
    of its sign."""
    e = {7.0: 2, 13.0: 3, 27.0: 4, 29.0: 4}[abs(value)]
    return (POS if value > 0 else NEG) + e - EXPONENT_MIN + 1


def test_reference_case_one_by_hand(kernels_run: dict[str, dict[str, object]]) -> None:
    fc1, relu1 = kernels_run["fc1"], kernels_run["relu1"]
    # fc1's output [7, -13, 27, -29]: mean -2, deviations 9, -11, 29, -27 (squares sum 1772)
    assert fc1["row"] == pytest.approx([-2, 443**0.5, -29, 27, 1788**0.5, 0, 0, 0])
    # relu1's [7, 0, 27, 0]: mean 8.5, deviations -1.5, -8.5, 18.5, -8.5 (squares sum 489)
    assert relu1["row"] == pytest.approx([8.5, (489 / 4) ** 0.5, 0, 27, 778**0.5, 2, 0, 0])
    hist = fc1["hist"]
    assert isinstance(hist, list)
    expected = {_bin(7.0): 1, _bin(-13.0): 1, _bin(27.0): 1, _bin(-29.0): 1}
    assert {i: c for i, c in enumerate(hist) if c} == expected
    relu_hist = relu1["hist"]
    assert isinstance(relu_hist, list)
    assert relu_hist[0] == 2  # ZERO


@pytest.mark.parametrize(
    "case",
    ["blocks", "channels_last", "transposed", "nan", "bfloat16", "float16", "subnormal", "float64"],
)
def test_the_kernels_give_torchs_route_numbers(
    kernels_run: dict[str, dict[str, object]], case: str
) -> None:
    result = kernels_run[case]
    assert result["usable"]
    assert result["row"] == pytest.approx(result["torch_row"], rel=1e-5, abs=1e-6, nan_ok=True)
    assert result["again"] == result["row"]  # the same tensor, the same row, bit for bit
    if case == "float64":  # binned by torch (exponents beyond float32's)
        assert result["hist"] is None
    else:
        assert result["hist"] == result["torch_hist"]


@pytest.mark.parametrize("case", ["fc1", "nan", "inf", "subnormal", "transposed", "float64"])
def test_a_tensor_of_one_block_takes_one_launch_and_gets_the_same_row(
    kernels_run: dict[str, dict[str, object]], case: str
) -> None:
    """Up to ``BLOCK`` values, ``alone`` makes the row in one launch: bit for bit the row the
    two launches make (one block's partial result, combined)."""
    result = kernels_run[case]
    assert result["one_block"]
    assert result["row"] == pytest.approx(result["blocks"], rel=0, abs=0, nan_ok=True)


@pytest.mark.parametrize("case", ["blocks", "nan", "bfloat16", "transposed"])
def test_blocks_combined_many_times_give_the_same_numbers(
    kernels_run: dict[str, dict[str, object]], case: str
) -> None:
    result = kernels_run[case]
    assert result["small_blocks"] == pytest.approx(result["row"], rel=1e-6, nan_ok=True)
    assert result["small_blocks_hist"] == result["hist"]


def test_an_inf_gives_the_cpus_mean_not_torchs_nan(
    kernels_run: dict[str, dict[str, object]],
) -> None:
    """torch's ``var_mean`` on a device says NaN for the mean of values holding an Inf; the
    CPU's routes, and the kernel, say what the mean is (Inf)."""
    row = kernels_run["inf"]["row"]
    assert isinstance(row, list)
    assert row[0] == float("inf") and row[1] != row[1]  # the std: NaN (inf - inf)
    assert row[2:] == [-2.0, float("inf"), float("inf"), 2.0, 0.0, 1.0]


def test_what_the_kernels_do_not_take_goes_torchs_way(
    kernels_run: dict[str, dict[str, object]],
) -> None:
    """Integers, empty, sparse and lazy tensors, and float64 histograms (exponents beyond
    float32's), are left to torch's route; and a CPU tensor, without the interpreter."""
    assert kernels_run["rejected"] == [False] * 5
    assert not device_kernels.usable(torch.ones(3))


@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16", "fp64"])
def test_the_kernels_compile_for_a_gpu(dtype: str) -> None:
    """Triton's compiler, all the way to the GPU's code (Hopper's, the H100's and H200's),
    without a GPU: what its interpreter lets pass and the compiler refuses is found here (a
    plain int read as a global was, first on a GPU)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from hooktrace.recorder.stats import triton_kernels

    target = GPUTarget("cuda", 90, 32)
    kernels = [
        (
            triton_kernels.partials,
            {"x_ptr": f"*{dtype}", "out_ptr": "*fp32", "n": "i32", "BLOCK": "constexpr"},
            {"BLOCK": device_kernels.BLOCK},
        ),
        (
            triton_kernels.alone,
            {"x_ptr": f"*{dtype}", "row_ptr": "*fp64", "n": "i32", "BLOCK": "constexpr"},
            {"BLOCK": device_kernels.BLOCK},
        ),
        (
            triton_kernels.combine,
            {"part_ptr": "*fp32", "blocks": "i32", "n": "i64", "row_ptr": "*fp64"}
            | {"PARTS": "constexpr"},
            {"PARTS": device_kernels.PARTS},
        ),
    ]
    if dtype != "fp64":  # (float64 histograms are torch's)
        signature = {"x_ptr": f"*{dtype}", "counts_ptr": "*i64", "n": "i64"}
        for alone in (False, True):
            constants = {
                "BLOCK": device_kernels.BLOCK,
                "BINS": device_kernels.HISTOGRAM_BINS,
                "ALONE": alone,
            }
            kernels.append(
                (
                    triton_kernels.bins,
                    signature | {"BLOCK": "constexpr", "BINS": "constexpr", "ALONE": "constexpr"},
                    constants,
                )
            )
    for kernel, signature, constants in kernels:
        compiled = triton.compile(
            ASTSource(fn=kernel, signature=signature, constexprs=constants),
            target=target,
            options=device_kernels._OPTIONS,
        )
        assert ".entry" in compiled.asm["ptx"]
        assert len(compiled.asm["cubin"]) > 0  # ptxas took it too


class _Broken:
    """Kernels that fail as a Triton that does not work here would (fault injection)."""

    def __getattr__(self, name: str) -> object:
        raise RuntimeError(f"no {name} here")


def test_kernels_that_fail_are_given_up_for_torchs_route_with_one_warning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # so that a CPU tensor is the kernels'
    monkeypatch.setattr(device_kernels, "_triton", _Broken)
    monkeypatch.setattr(device_kernels, "_failed", [])
    monkeypatch.setattr(device_kernels, "_proven", {})
    with pytest.warns(RuntimeWarning, match="kernels are not used .*RuntimeError: no partials"):
        assert not device_kernels.usable(torch.ones(3))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert not device_kernels.usable(torch.ones(3, dtype=torch.float16))


def test_a_kernel_failing_after_its_proof_hands_the_tensor_to_torchs_route(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(device_kernels, "_triton", _Broken)
    monkeypatch.setattr(device_kernels, "_failed", [])
    with pytest.warns(RuntimeWarning, match="kernels are not used"):
        assert device_kernels.summarize(torch.ones(3)) is None
    assert device_kernels._failed  # and no tensor is theirs from now on


def test_a_warning_made_an_error_does_not_escape(monkeypatch: pytest.MonkeyPatch) -> None:
    """``-W error`` makes the give-up's warning an exception: the kernels are given up all
    the same (``usable`` never raises), and nothing reaches the training."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(device_kernels, "_triton", _Broken)
    monkeypatch.setattr(device_kernels, "_failed", [])
    monkeypatch.setattr(device_kernels, "_proven", {})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not device_kernels.usable(torch.ones(3))
    assert device_kernels._failed
