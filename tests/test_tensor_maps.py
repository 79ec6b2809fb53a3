"""The Hopper forward's tensor-map layouts (fa2cupy/tensor_maps.py): which arrays TMA can copy, and the dims,
strides and boxes a map gets. CPU only: encoding a map needs the driver, which the GPU tests exercise."""

from __future__ import annotations

import pytest

from fa2cupy import build, tensor_maps


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


def test_varlen_maps_span_the_packed_rows():
    q, k, v, out = tensor_maps.array_shapes((3, 700, 8, 128), (3, 900, 2, 128), (1234, 0))
    assert q == out == (1, 1234, 8, 128)
    assert k == v == (1, 1, 2, 128)  # no keys at all: one row, never read
    assert tensor_maps.array_shapes((3, 700, 8, 64), (3, 900, 2, 64)) == ((3, 700, 8, 64), (3, 900, 2, 64),
                                                                         (3, 900, 2, 64), (3, 700, 8, 64))


@pytest.mark.parametrize("shape,element_strides,promotion", [
    ((2, 1000, 16, 128), (1000 * 16 * 128, 16 * 128, 128, 1), 256),  # the next 128 bytes: the row's columns 64-127
    ((2, 1000, 16, 64), (1000 * 16 * 64, 16 * 64, 64, 1), 128),  # the next head's row, read by other items
    ((2, 1000, 16, 64), (16 * 1000 * 64, 64, 1000 * 64, 1), 256),  # heads first: the tile's next row
    ((2, 1000, 1, 64), (1000 * 64, 64, 64, 1), 256),  # one head: the next row
    ((2, 1000, 4, 64), (1000 * 3 * 4 * 64, 3 * 4 * 64, 64, 1), 128),  # q of a packed qkv: the next head's q
])
def test_l2_promotion_fetches_only_bytes_the_same_tile_reads(shape, element_strides, promotion):
    dims, byte_strides, _ = tensor_maps.layout(shape, element_strides, 128)
    assert tensor_maps.l2_promotion(dims, byte_strides) == {128: 2, 256: 3}[promotion]


class _Driver:
    """Stands in for the driver's cuTensorMapEncodeTiled: records the calls, fails where told."""

    def __init__(self, status=0):
        self.calls, self.status = [], status

    def cuTensorMapEncodeTiled(self, address, dtype, rank, pointer, dims, strides, box, element_strides, *modes):
        self.calls.append((address, pointer, tuple(dims), tuple(strides), tuple(box), modes[2]))
        return self.status

    def cuGetErrorName(self, status, name):
        name._obj.value = b"CUDA_ERROR_INVALID_VALUE"
        return 0


def _maps():
    layout = tensor_maps.layout((2, 100, 4, 64), (100 * 4 * 64, 4 * 64, 64, 1), 128)
    return tensor_maps.TileMaps([layout] * 4)


def test_maps_are_encoded_again_only_where_a_pointer_changed(monkeypatch):
    driver = _Driver()
    monkeypatch.setattr(build, "_driver", lambda: driver)
    maps = _maps()
    addresses = (4096, 4224, 4352, 4480)
    maps.writer((16, 32, 48, 64))(addresses)
    assert [c[:2] for c in driver.calls] == list(zip(addresses, (16, 32, 48, 64)))
    assert driver.calls[0][2:] == ((64, 4, 100, 2), (128, 512, 51200), (64, 1, 128, 1), 2)  # 128-byte promotion
    driver.calls.clear()
    maps.writer((16, 32, 48, 80))(addresses)  # a new output array only
    assert [c[:2] for c in driver.calls] == [(4480, 80)]


def test_a_map_the_driver_refuses_raises_and_is_encoded_again(monkeypatch):
    driver = _Driver(status=1)
    monkeypatch.setattr(build, "_driver", lambda: driver)
    maps = _maps()
    with pytest.raises(RuntimeError, match="cuTensorMapEncodeTiled failed for array 0.*CUDA_ERROR_INVALID_VALUE"):
        maps.encode((4096,) * 4, (16,) * 4)
    driver.status = 0
    maps.encode((4096,) * 4, (16,) * 4)
    assert len(driver.calls) == 5  # the refused map, then all four


def test_maps_the_kernel_does_not_read_are_never_encoded(monkeypatch):
    # (paged K/V: the Hopper forward maps q and out only)
    driver = _Driver()
    monkeypatch.setattr(build, "_driver", lambda: driver)
    layout = tensor_maps.layout((1, 300, 4, 64), (300 * 4 * 64, 4 * 64, 64, 1), 128)
    maps = tensor_maps.TileMaps([layout, None, None, layout])
    maps.writer((16, 32, 48, 64))((4096, 4224, 4352, 4480))
    assert [c[:2] for c in driver.calls] == [(4096, 16), (4480, 64)]


def test_the_dq_accumulator_map_spans_the_head_dim_of_rows_as_staged(monkeypatch):
    # (the Hopper backward's dQ reductions: a staging tile's rows of `pitch` floats, only the call's columns added)
    dims, strides, box = tensor_maps.accumulator_layout(2 * 16 * 1000, 80, 136, 64)
    assert (dims, strides, box) == ((80, 32000), (544,), (136, 64))
    driver = _Driver()
    monkeypatch.setattr(build, "_driver", lambda: driver)
    tile = tensor_maps.layout((2, 1000, 16, 80), (1000 * 16 * 80, 16 * 80, 80, 1), 64)
    maps = tensor_maps.TileMaps([tile, None, None, None, (dims, strides, box)])
    maps.writer((16, 0, 0, 0, 64))((4096, 0, 0, 0, 4608))
    assert driver.calls[1] == (4608, 64, (80, 32000), (544,), (136, 64), 0)  # fp32, no swizzle, no promotion


def test_only_calls_narrower_than_their_row_reduce_dq_through_the_map():
    from fa2cupy import configs

    row128, row64, row256 = (configs.HopperBwdConfig(d, m, 2, d == 64) for d, m in ((128, 64), (64, 128), (256, 64)))
    assert row128.dq_pitch(128) == 136  # (rows on 32-byte sectors)
    assert [row128.dq_by_map(d) for d in (80, 96, 120, 128)] == [True, True, True, False]
    assert row64.dq_by_map(40) and not row64.dq_by_map(64)
    assert not row256.dq_by_map(224)  # (a box of 264 columns is past TMA's 256)
    assert row64.dq_by_map(40, varlen=True) and not row64.dq_by_map(40, varlen=True, mods=True)  # (spilled)
