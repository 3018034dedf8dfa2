"""numpy's view of a CPU tensor (hooktrace.recorder.stats.host): what ``Tensor.numpy()`` gives,
without marking the tensor's storage as never to be resized again."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from hooktrace.recorder.records.pending import to_numpy
from hooktrace.recorder.stats.histogram import _histogram_bits
from hooktrace.recorder.stats.host import as_numpy


def test_numpy_itself_pins_a_storage_which_is_why_the_view_exists() -> None:
    tensor = torch.ones(8)
    tensor.numpy()
    assert not tensor.untyped_storage().resizable()


@pytest.mark.parametrize(
    "dtype",
    [torch.float32, torch.float64, torch.float16, torch.int64, torch.int32, torch.int16,
     torch.int8, torch.uint8, torch.bool, torch.complex64],
)  # fmt: skip
@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "empty", "scalar"])
def test_the_view_is_what_numpy_gives_and_leaves_the_storage_resizable(
    dtype: torch.dtype, layout: str
) -> None:
    base = (torch.arange(-12, 12).reshape(4, 6) * 3).to(dtype)
    tensor = {
        "contiguous": base,
        "transposed": base.t(),
        "sliced": base[1:, ::2],
        "empty": base[:0],
        "scalar": base[1, 1],
    }[layout]
    view = as_numpy(tensor)
    assert tensor.untyped_storage().resizable()
    expected = tensor.clone().numpy()
    assert view.dtype == expected.dtype and view.shape == expected.shape
    np.testing.assert_array_equal(view, expected)
    if tensor.numel():  # the same memory, not a copy
        assert view.__array_interface__["data"][0] == tensor.data_ptr()


@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64])  # by address, by DLPack
def test_the_view_of_a_temporary_keeps_its_memory(dtype: torch.dtype) -> None:
    """Found by the full tensors' test: a view of ``tensor.contiguous()``'s copy outlived it,
    and a full tensor was saved from freed memory."""
    view = as_numpy((torch.arange(4096.0) * 2).to(dtype))
    gc.collect()
    overwrite = [torch.full((4096,), -1.0) for _ in range(16)]
    np.testing.assert_array_equal(view, np.arange(4096.0) * 2)
    assert len(overwrite) == 16


def test_a_tensor_that_requires_grad_is_viewed_as_its_values() -> None:
    weight = torch.nn.Parameter(torch.tensor([1.5, -2.0]))
    np.testing.assert_array_equal(as_numpy(weight), [1.5, -2.0])
    assert weight.untyped_storage().resizable()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_full_tensors_and_captures_leave_the_storage_resizable(dtype: torch.dtype) -> None:
    tensor = torch.tensor([0.5, -2.0, 4.0]).to(dtype)
    array, name = to_numpy(tensor)
    assert tensor.untyped_storage().resizable()
    assert name == str(dtype).removeprefix("torch.")
    assert array.tobytes() == bytes(tensor.untyped_storage())  # the exact bits


def test_the_numpy_histogram_route_leaves_the_storage_resizable() -> None:
    tensor = torch.tensor([0.0, 1.0, -3.0, 2.5]).t()
    _histogram_bits(tensor, False)
    assert tensor.untyped_storage().resizable()
