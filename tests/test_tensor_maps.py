"""The Hopper forward's tensor-map layouts (fa2cupy/tensor_maps.py): which arrays TMA can copy, and the dims,
strides and boxes a map gets. CPU only: encoding a map needs the driver, which the GPU tests exercise."""

from __future__ import annotations

import pytest

from fa2cupy import tensor_maps


def test_packed_layout_maps_head_dim_head_row_batch():
    dims, strides, box = tensor_maps.layout((2, 1000, 16, 128), (1000 * 16 * 128, 16 * 128, 128, 1), 192)
    assert dims == (128, 16, 1000, 2)
    assert strides == (256, 16 * 128 * 2, 1000 * 16 * 128 * 2)
    assert box == (64, 1, 192, 1)


def test_heads_first_layout_keeps_its_strides():
    # (batch, nheads, seqlen, d) memory viewed as (batch, seqlen, nheads, d): the head stride is the larger one.
    dims, strides, _ = tensor_maps.layout((2, 300, 4, 64), (4 * 300 * 64, 64, 300 * 64, 1), 128)
    assert dims == (64, 4, 300, 2)
    assert strides == (300 * 64 * 2, 64 * 2, 4 * 300 * 64 * 2)


@pytest.mark.parametrize("shape,element_strides", [
    ((1, 128, 8, 64), (0, 8 * 64, 64, 1)),  # one batch row: its stride is never used (here 0)
    ((3, 1, 8, 64), (8 * 64, 8, 64, 1)),  # one row: likewise its stride (here 8 elements, 16 bytes)
    ((3, 77, 1, 128), (77 * 128, 128, 12345, 1)),  # one head: likewise
])
def test_strides_of_single_entry_dimensions_are_replaced(shape, element_strides):
    _, strides, _ = tensor_maps.layout(shape, element_strides, 128)
    assert all(s > 0 and s % 16 == 0 for s in strides)
    assert tensor_maps.usable(shape, element_strides)


@pytest.mark.parametrize("element_strides", [
    (1000 * 16 * 128, -16 * 128, 128, 1),  # rows in reverse
    (1000 * 16 * 128, 16 * 128, -128, 1),  # heads in reverse
    (-1000 * 16 * 128, 16 * 128, 128, 1),  # batch rows in reverse
    (1000 * 16 * 128, 16 * 128 + 4, 128, 1),  # rows 8 bytes off a 16-byte multiple
])
def test_arrays_tma_cannot_copy_are_refused(element_strides):
    assert not tensor_maps.usable((2, 1000, 16, 128), element_strides)


def test_row_strides_beyond_the_tensor_memory_accelerator_are_refused():
    assert not tensor_maps.usable((2, 1000, 16, 128), (1 << 40, 1 << 39, 128, 1))
