"""Bad values that only the GPU sees: index arrays (cache_seqlens, cache_batch_idx, block_table) live in device
memory, and reading them on the host would cost a synchronisation per call, which a decode loop (or a CUDA graph)
cannot afford.

So the kernels check them (cuda/common/errors.cuh ``report_bad_value``): the first thread to find a bad value claims a
per-device word with atomicExch and writes what, where and which value into pinned host memory mapped into the
GPU's address space; while a report is pending, the kernels write NaN rows and the append writes nothing. The host
reads that memory without synchronising: the next call raises, or :func:`check_device_errors` waits for the GPU
and raises. Like CUDA's own asynchronous errors, the exception may surface one call late, but a bad value never
produces a plausible-looking number.
"""

from __future__ import annotations

import ctypes

import numpy as np

#: What the kernels report (enum BadValue in cuda/common/errors.cuh).
(_BAD_CACHE_SEQLEN, _BAD_CACHE_BATCH_IDX, _BAD_BLOCK_TABLE, _BAD_CU_SEQLENS_Q, _BAD_CU_SEQLENS_K,
 _BAD_ROTARY_POSITION, _BAD_CACHE_LEFTPAD, _BAD_VARLEN_PAGE) = 1, 2, 3, 4, 5, 6, 7, 8

_report = None  # numpy int64[3] view of the mapped host words: [0] what, [1] row << 32 | col, [2] value
_report_device_ptr = 0
_claims: dict[int, object] = {}  # device -> cupy int32[1], 0 while no report is pending


def _cupy():
    import cupy

    return cupy


_pointers: dict[int, tuple[int, int]] = {}


def pointers(device: int) -> tuple[int, int]:
    """(claim word, report words) device pointers for kernels on ``device`` (the current device)."""
    found = _pointers.get(device)
    if found is None:
        found = _pointers[device] = _make_pointers(device)
    return found


def _make_pointers(device: int) -> tuple[int, int]:
    global _report, _report_device_ptr
    cupy = _cupy()
    runtime = cupy.cuda.runtime
    if _report is None:
        host = runtime.hostAlloc(3 * 8, runtime.hostAllocPortable | runtime.hostAllocMapped)
        view = np.ctypeslib.as_array((ctypes.c_int64 * 3).from_address(host))
        view[:] = 0
        # With unified addressing the device address of mapped host memory is its host address; ask anyway.
        _report_device_ptr = runtime.pointerGetAttributes(host).devicePointer or host
        _report = view
    claim = _claims.get(device)
    if claim is None:
        claim = _claims[device] = cupy.zeros(1, dtype=cupy.int32)
    return claim.data.ptr, _report_device_ptr


def pending() -> bool:
    """Whether a kernel has reported a bad value that was not raised yet (no synchronisation)."""
    return _report is not None and _report[0] != 0


def _synchronize() -> None:
    """Waits for every device a kernel may be reporting from."""
    cupy = _cupy()
    for device in list(_claims):
        with cupy.cuda.Device(device):
            cupy.cuda.runtime.deviceSynchronize()


def raise_pending() -> None:
    """Raises the pending report, if any, as a ValueError naming the argument, and clears it."""
    if pending():
        _synchronize()  # let every kernel that may still write a report finish before clearing
        _raise_and_clear()


def check_device_errors() -> None:
    """Waits for the GPU, then raises the first bad index value a kernel found since the last check (ValueError
    naming the argument, its position and its value). Also raised, without waiting, by the next
    ``flash_attn_with_kvcache`` call."""
    if _report is None:
        return
    _synchronize()
    if pending():
        _raise_and_clear()


def _raise_and_clear() -> None:
    what, where, value = (int(x) for x in _report)
    row, col = where >> 32, where & 0xFFFFFFFF
    col = col - (1 << 32) if col >= 1 << 31 else col  # a signed int in the report's low word
    _report[:] = 0
    for claim in _claims.values():
        with _cupy().cuda.Device(claim.device.id):
            claim.fill(0)
    _synchronize()
    after = ("(found on the GPU by a flash_attn_with_kvcache call, which wrote nothing to the caches and returned "
             "NaN for the rows it could not compute)")
    if what == _BAD_CACHE_SEQLEN:
        raise ValueError(f"cache_seqlens[{row}] = {value}: each row's cache_seqlens must lie in [0, capacity - "
                         f"seqlen_new] so that the appended keys fit in the cache {after}")
    if what == _BAD_CACHE_BATCH_IDX:
        raise ValueError(f"cache_batch_idx[{row}] = {value} is not a row of k_cache (0 <= cache_batch_idx < "
                         f"k_cache.shape[0]) {after}")
    if what in (_BAD_CU_SEQLENS_Q, _BAD_CU_SEQLENS_K):
        name, side = ("cu_seqlens_q", "q") if what == _BAD_CU_SEQLENS_Q else ("cu_seqlens_k", "k")
        raise ValueError(f"{name}[{row}:{row + 2}] = ({col}, {value}) is not a sequence of the packed {side}: each "
                         f"needs 0 <= start <= end <= {side}.shape[0] and end - start <= max_seqlen_{side} (found on "
                         f"the GPU by a varlen call, which did not compute that sequence: its rows of the output and "
                         f"gradients are not valid)")
    if what == _BAD_ROTARY_POSITION:
        raise ValueError(f"cache_seqlens[{row}] places a rotated token at position {value}, past the rows of "
                         f"rotary_cos / rotary_sin; they must cover every position rotated {after}")
    if what == _BAD_CACHE_LEFTPAD:
        raise ValueError(f"cache_leftpad[{row}] = {value} must lie in [0, cache_seqlens[{row}]] {after}")
    if what == _BAD_VARLEN_PAGE:
        raise ValueError(f"block_table[{row}, {col}] = {value} is not a page of k (0 <= page < k.shape[0]) (found on "
                         f"the GPU by flash_attn_varlen_func, which read that page as zeros: the output rows of "
                         f"sequence {row} are not valid)")
    if what == _BAD_BLOCK_TABLE:
        raise ValueError(f"block_table[{row}, {col}] = {value} is not a page of k_cache (0 <= page < "
                         f"k_cache.shape[0]) {after}")
    raise RuntimeError(f"fa2cupy kernel reported an unknown error code {what} {after}")
