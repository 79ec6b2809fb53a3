"""Tensor maps for the Hopper kernels' TMA copies (cuda/hopper/fwd.cu, cuda/hopper/bwd.cu).

A tensor map (CUtensorMap, 128 opaque bytes) describes one array to the tensor memory accelerator: its address,
sizes, strides, the box a copy moves and the shared-memory swizzle. The driver encodes it on the host
(``cuTensorMapEncodeTiled``) straight into the launch's parameter struct (cuda/common/params.cuh), which the kernel
takes by value as a ``__grid_constant__`` parameter. The maps here view a ``(batch, seqlen, nheads, headdim)`` array
as four dimensions, innermost first: the head dim, the head, the row, the batch row; a box is 64 columns (128 bytes,
the 128-byte swizzle of cuda/sm90/slabs.cuh's SwizzledSlabs) by one head by a tile's rows. Rows past ``seqlen`` read
as zeros and are not written. The backward's fp32 dQ accumulator has a map of two dimensions
(:func:`accumulator_layout`) for its reductions.
"""

from __future__ import annotations

import ctypes

from . import build

_UINT16 = 1  # CU_TENSOR_MAP_DATA_TYPE_UINT16 (fp16 and bf16 alike: the copies move bits)
_FLOAT32 = 7  # CU_TENSOR_MAP_DATA_TYPE_FLOAT32 (the reductions add fp32)
_INTERLEAVE_NONE = 0
_SWIZZLE_NONE = 0
_SWIZZLE_128B = 3
_L2_PROMOTION_NONE = 0
_L2_PROMOTION_128B = 2
_L2_PROMOTION_256B = 3
_OOB_FILL_ZEROS = 0  # CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE


def layout(shape, strides, rows: int):
    """``(dims, byte strides, box)`` of one array's map: ``shape`` ``(batch, seqlen, nheads, headdim)``, ``strides``
    its element strides (``(batch, row, head, 1)``), boxes of 64 columns by ``rows`` rows. A dimension of size 1 gets
    the stride of a packed layout (its own is never used, and may be 0 or unaligned)."""
    batch, seqlen, nheads, headdim = shape
    batch_stride, row_stride, head_stride = strides[:3]
    if nheads == 1:
        head_stride = headdim
    if seqlen == 1:
        row_stride = head_stride * nheads
    if batch == 1:
        batch_stride = row_stride * seqlen
    dims = (headdim, nheads, seqlen, batch)
    byte_strides = (2 * head_stride, 2 * row_stride, 2 * batch_stride)
    return dims, byte_strides, (64, 1, rows, 1)


def accumulator_layout(rows: int, columns: int, pitch: int, box_rows: int):
    """``(dims, byte strides, box)`` of the map of the Hopper backward's fp32 dQ accumulator, ``rows`` rows of
    ``pitch`` floats, spanning the first ``columns`` of each (the arrays' head dim): a box is a staging tile as the
    kernel stores it, ``pitch`` floats by ``box_rows`` rows, and a reduction of it adds only the columns inside the
    map (cuda/sm90/tma.cuh: tma_reduce_add_2d). ``pitch`` is at most 256, a box's limit."""
    return (columns, max(1, rows)), (4 * pitch,), (pitch, box_rows)


def l2_promotion(dims, byte_strides) -> int:
    """The L2 promotion of a map's copies: 256 bytes where the 128 bytes after each box row are read by the same
    tile (a row's columns 64-127, or with 64 columns the next row when rows lie 128 bytes apart), else 128. At head
    dim 64 in a ``(batch, seqlen, nheads, 64)`` array those bytes are the next head's row, which only that head's
    items read, long after L2 has dropped it: with 256 the (4096, 0) window forward over 64k tokens read 1.16 GB from
    DRAM instead of 0.81 (ncu, H200)."""
    headdim, row_stride = dims[0], byte_strides[1]
    return _L2_PROMOTION_256B if headdim > 64 or row_stride == 128 else _L2_PROMOTION_128B


def array_shapes(q_shape, k_shape, varlen_totals=None, headdim_v=None):
    """The ``(batch, seqlen, nheads, headdim)`` shapes the maps of q, k, v and a q-shaped fourth array (out, or dout)
    take: the call's own, or with ``varlen_totals = (total_q, total_k)`` one batch row over the packed arrays' rows
    (at least one: a map has no empty dimension); with ``headdim_v``, v's and the fourth's head dim."""
    nheads, headdim, nheads_kv = q_shape[2], q_shape[3], k_shape[2]
    if varlen_totals:
        q_shape = (1, max(1, varlen_totals[0]), nheads, headdim)
        k_shape = (1, max(1, varlen_totals[1]), nheads_kv, headdim)
    if headdim_v is None:
        return q_shape, k_shape, k_shape, q_shape
    return q_shape, k_shape, k_shape[:3] + (headdim_v,), q_shape[:3] + (headdim_v,)


def usable(shape, strides) -> bool:
    """Whether TMA can copy the array: positive strides, multiples of 16 bytes below 2**40, as :func:`layout` takes
    them (the kernel's other requirements, 16-byte aligned rows, hold for every planned array)."""
    _, byte_strides, _ = layout(shape, strides, 1)
    return all(0 < s < 1 << 40 and s % 16 == 0 for s in byte_strides)


class TileMaps:
    """The maps of q, k, v and out for one plan, encoded into a launch's struct (build.Launch's ``maps`` fields)
    for a call's pointers; a map whose pointer is the last call's is left as it is. A layout of ``None`` is a map the
    kernel does not read (paged K/V): never encoded, its parameter left zero."""

    __slots__ = ("_arrays", "_last")

    def __init__(self, layouts):
        self._arrays = []
        for entry in layouts:
            if entry is None:
                self._arrays.append(None)
                continue
            dims, byte_strides, box = entry
            rank = len(dims)
            # (four dimensions: a 16-bit array's tiles, swizzled; two: the fp32 accumulator's, as stored)
            kind = ((_UINT16, _SWIZZLE_128B, l2_promotion(dims, byte_strides)) if rank == 4
                    else (_FLOAT32, _SWIZZLE_NONE, _L2_PROMOTION_NONE))
            self._arrays.append((rank, (ctypes.c_uint64 * rank)(*dims), (ctypes.c_uint64 * (rank - 1))(*byte_strides),
                                 (ctypes.c_uint32 * rank)(*box), (ctypes.c_uint32 * rank)(*(1,) * rank), *kind))
        self._last = [None] * len(layouts)

    def writer(self, pointers):
        """What build.Launch takes as ``write_maps``: these maps encoded for ``pointers`` (q, k, v, out)."""
        return lambda addresses: self.encode(addresses, pointers)

    def encode(self, addresses, pointers) -> None:
        lib = build._driver()
        for i, (address, pointer) in enumerate(zip(addresses, pointers)):
            if self._arrays[i] is None or self._last[i] == (address, pointer):
                continue
            rank, dims, byte_strides, box, element_strides, dtype, swizzle, promotion = self._arrays[i]
            status = lib.cuTensorMapEncodeTiled(address, dtype, rank, pointer, dims, byte_strides, box,
                                                element_strides, _INTERLEAVE_NONE, swizzle, promotion,
                                                _OOB_FILL_ZEROS)
            if status:
                self._last[i] = None
                raise RuntimeError(f"cuTensorMapEncodeTiled failed for array {i} (q, k, v, out or dout, then the dQ "
                                   f"accumulator) with dims "
                                   f"{tuple(dims)}, byte strides {tuple(byte_strides)}: {build.driver_error(status)}")
            self._last[i] = (address, pointer)
