"""The kernels' parameter structs (cuda/common/params.cuh), mirrored field by field as ctypes Structures.

A launch (build.Launch) holds one struct in its parameter buffer: a plan sets the fixed fields by name when it is
made, a call writes its per-call fields (pointers, dropout words, ...) by name through offsets taken from these
classes once. tests/test_params.py compiles a probe that checks every field's offset and size and every struct's
size here against the CUDA header, so the two cannot drift apart.

Pointers are ``c_uint64`` (a device address is an integer here); the other fields have the CUDA field's type. ctypes
lays the fields out as the C ABI does, as NVRTC does for the device; the one thing it cannot say (before Python 3.13)
is an alignment beyond 8 bytes: :func:`_layout` inserts the padding that ``alignas(64)`` (TensorMap) puts in the
CUDA struct.
"""

from __future__ import annotations

import ctypes

_ptr = _u64 = ctypes.c_uint64
_i64, _i32, _u32, _f32 = ctypes.c_int64, ctypes.c_int32, ctypes.c_uint32, ctypes.c_float

#: A CUtensorMap (cuda/common/types.cuh: TensorMap): 128 opaque bytes, aligned to 64 bytes in the structs.
TENSOR_MAP_BYTES = 128
TENSOR_MAP_ALIGN = 64
TensorMap = ctypes.c_uint64 * (TENSOR_MAP_BYTES // 8)


def _layout(fields) -> list:
    """``_fields_`` for ``fields``, a list of ``(name, ctype)`` or ``(name, ctype, alignment)``: explicit padding
    (``_pad<n>``, bytes) before each field whose alignment exceeds its type's, and at the end up to the largest
    alignment, as the C++ struct has them (ctypes aligns each field to its own type)."""
    out, offset, largest = [], 0, 1
    for name, ctype, *extra in fields:
        natural = ctypes.alignment(ctype)
        align = extra[0] if extra else natural
        largest = max(largest, align)
        start = -(-offset // align) * align
        if align > natural and start > offset:
            out.append((f"_pad{len(out)}", ctypes.c_ubyte * (start - offset)))
        out.append((name, ctype))
        offset = start + ctypes.sizeof(ctype)
    end = -(-offset // largest) * largest
    if end > offset and largest > max(ctypes.alignment(ctype) for _, ctype, *_ in fields):
        out.append((f"_pad{len(out)}", ctypes.c_ubyte * (end - offset)))
    return out


class _Params(ctypes.Structure):
    """A parameter struct whose integer fields, set by keyword when it is made, must fit their type: a value that
    would wrap (ctypes stores the low bits) raises OverflowError naming the field."""

    def __init__(self, **fields):
        super().__init__()
        self.set(**fields)

    def set(self, **fields):
        """Sets fields by name (checked as when the struct is made); returns the struct."""
        for name, value in fields.items():
            setattr(self, name, value)
            stored = getattr(self, name)
            if isinstance(stored, int) and stored != value:
                raise OverflowError(f"{type(self).__name__}.{name} = {value} does not fit its "
                                    f"{dict(self._fields_)[name].__name__}")
        return self


def _strides(prefix: str) -> list:
    return [(f"{prefix}_batch_stride", _i64), (f"{prefix}_row_stride", _i32), (f"{prefix}_head_stride", _i64)]


class FwdParams(_Params):
    _fields_ = _layout([
        ("q", _ptr), ("k", _ptr), ("v", _ptr), ("o", _ptr), ("lse", _ptr), ("cu_seqlens_q", _ptr),
        ("cu_seqlens_k", _ptr), ("alibi_slopes", _ptr), ("rng_state", _ptr), ("block_table", _ptr),
        ("error_claim", _ptr), ("error_host", _ptr),
        *_strides("q"), *_strides("k"), *_strides("v"), *_strides("o"),
        ("lse_batch_stride", _i64), ("lse_head_stride", _i64),
        ("max_seqlen_q", _i32), ("max_seqlen_k", _i32), ("nheads", _i32), ("heads_per_kv", _i32), ("headdim", _i32),
        ("headdim_v", _i32), ("total_q", _i32), ("total_k", _i32),
        ("window_left", _i32), ("window_right", _i32), ("scale", _f32), ("scale_log2", _f32), ("softcap", _f32),
        ("alibi_batch_stride", _i32), ("dropout_threshold", _u32), ("dropout_scale", _f32),
        ("page_size", _i32), ("page_magic", _u32), ("page_shift", _i32), ("max_pages", _i32), ("num_pages", _i32),
        ("seed", _u64), ("offset", _u64),
    ])


class FwdHopperParams(_Params):
    _fields_ = _layout([
        ("fwd", FwdParams), ("batch", _i32), ("heads_per_group", _i32), ("tile_counter", _ptr),
        ("mods_unit", _f32), ("mods_unit_inv", _f32), ("tail_heads", _i32),
        ("tmap_q", TensorMap, TENSOR_MAP_ALIGN), ("tmap_k", TensorMap, TENSOR_MAP_ALIGN),
        ("tmap_v", TensorMap, TENSOR_MAP_ALIGN), ("tmap_o", TensorMap, TENSOR_MAP_ALIGN),
    ])


class BwdParams(_Params):
    _fields_ = _layout([
        ("q", _ptr), ("k", _ptr), ("v", _ptr), ("out", _ptr), ("dout", _ptr), ("lse", _ptr), ("dsum", _ptr),
        ("dq_accum", _ptr), ("dq", _ptr), ("dk", _ptr), ("dv", _ptr), ("cu_seqlens_q", _ptr), ("cu_seqlens_k", _ptr),
        ("alibi_slopes", _ptr), ("rng_state", _ptr), ("error_claim", _ptr), ("error_host", _ptr),
        *_strides("q"), *_strides("k"), *_strides("v"), *_strides("o"), *_strides("do"), *_strides("dq"),
        *_strides("dk"), *_strides("dv"), ("stat_batch_stride", _i64), ("stat_head_stride", _i64),
        ("max_seqlen_q", _i32), ("max_seqlen_k", _i32), ("nheads", _i32), ("heads_per_kv", _i32), ("headdim", _i32),
        ("headdim_v", _i32), ("total_q", _i32), ("total_k", _i32), ("batch", _i32), ("q_row_elems", _i32),
        ("kv_row_elems", _i32),
        ("dq_pitch", _i32), ("lanes", _i32),
        ("window_left", _i32), ("window_right", _i32), ("scale", _f32), ("scale_log2", _f32), ("softcap", _f32),
        ("alibi_batch_stride", _i32), ("dropout_threshold", _u32), ("dropout_scale", _f32),
        ("seed", _u64), ("offset", _u64), ("dq_arrivals", _ptr), ("arrival_block_m", _i32), ("arrival_block_n", _i32),
    ])


class BwdHopperParams(_Params):
    _fields_ = _layout([
        ("bwd", BwdParams), ("group_chunk", _i32), ("dq_rotate", _i32), ("deterministic", _i32),
        ("dq_by_map", _i32),
        ("dq_semaphore", _ptr),
        ("tmap_q", TensorMap, TENSOR_MAP_ALIGN), ("tmap_k", TensorMap, TENSOR_MAP_ALIGN),
        ("tmap_v", TensorMap, TENSOR_MAP_ALIGN), ("tmap_do", TensorMap, TENSOR_MAP_ALIGN),
        ("tmap_dq", TensorMap, TENSOR_MAP_ALIGN),
    ])


class DecodeParams(_Params):
    _fields_ = _layout([
        ("q", _ptr), ("k_cache", _ptr), ("v_cache", _ptr), ("k_new", _ptr), ("v_new", _ptr), ("block_table", _ptr),
        ("cache_seqlens", _ptr), ("cache_batch_idx", _ptr), ("cache_leftpad", _ptr), ("rotary_cos", _ptr),
        ("rotary_sin", _ptr), ("alibi_slopes", _ptr), ("out", _ptr), ("lse_out", _ptr), ("q_rotated", _ptr),
        ("partial_out", _ptr), ("partial_lse", _ptr), ("arrivals", _ptr), ("error_claim", _ptr),
        ("error_host", _ptr),
        *_strides("q"), *_strides("k"), *_strides("v"), *_strides("k_new"), *_strides("v_new"),
        ("alibi_batch_stride", _i64),
        ("batch", _i32), ("seqlen_q", _i32), ("nheads", _i32), ("nheads_kv", _i32), ("heads_per_kv", _i32),
        ("headdim", _i32), ("headdim_v", _i32), ("seqlen_new", _i32), ("capacity", _i32), ("cache_rows", _i32),
        ("page_size", _i32), ("max_pages", _i32),
        ("scale", _f32), ("scale_log2", _f32), ("window_left", _i32), ("window_right", _i32), ("softcap", _f32),
        ("rotary_dim", _i32), ("seqlen_ro", _i32), ("rotary_interleaved", _i32), ("rotary_advance", _i32),
        ("q_span", _i32), ("num_splits", _i32),
        ("splits_magic", _u32), ("splits_shift", _i32), ("groups_magic", _u32), ("groups_shift", _i32),
        ("heads_kv_magic", _u32), ("heads_kv_shift", _i32), ("heads_per_kv_magic", _u32),
        ("heads_per_kv_shift", _i32), ("page_size_magic", _u32), ("page_size_shift", _i32),
        ("programmatic", _i32), ("stream_larger_than_l2", _i32), ("fixed_seqlen", _i64),
    ])


class MergeParams(_Params):
    _fields_ = _layout([("parts", _ptr), ("lses", _ptr), ("out", _ptr), ("lse_out", _ptr), ("rows", _i64),
                        ("n", _i32), ("headdim", _i32)])


class DropoutMaskParams(_Params):
    _fields_ = _layout([("mask", _ptr), ("seqlen_q", _i32), ("seqlen_k", _i32), ("nheads", _i32),
                        ("threshold", _u32), ("seed", _u64), ("offset", _u64)])


#: Every mirrored struct by its CUDA name (in namespace fa2).
STRUCTS = {cls.__name__: cls for cls in (FwdParams, FwdHopperParams, BwdParams, BwdHopperParams, DecodeParams,
                                         MergeParams, DropoutMaskParams)}


def alignment(struct: type) -> int:
    """The CUDA struct's alignment: 64 bytes where it holds a tensor map, else its ctypes alignment."""
    if any(ctype is TensorMap or (isinstance(ctype, type) and issubclass(ctype, ctypes.Structure)
                                  and alignment(ctype) == TENSOR_MAP_ALIGN) for _, ctype in struct._fields_):
        return TENSOR_MAP_ALIGN
    return ctypes.alignment(struct)


def field(struct: type, path: str) -> tuple[int, type]:
    """``(offset, ctype)`` of a field of ``struct`` by name; a dotted path names a field of a nested struct
    (``"fwd.q"``). Raises AttributeError for a name the struct does not have."""
    offset, ctype = 0, struct
    for name in path.split("."):
        types = dict(getattr(ctype, "_fields_", ()))
        if name not in types or name.startswith("_pad"):
            raise AttributeError(f"{struct.__name__} has no field {path!r}")
        offset += getattr(ctype, name).offset
        ctype = types[name]
    return offset, ctype


def fields(struct: type, prefix: str = ""):
    """Every field of ``struct`` as ``(path, offset, size)``, nested structs' fields by dotted path after the
    nested struct itself (padding left out)."""
    for name, ctype in struct._fields_:
        if name.startswith("_pad"):
            continue
        offset = getattr(struct, name).offset
        yield prefix + name, offset, ctypes.sizeof(ctype)
        if isinstance(ctype, type) and issubclass(ctype, ctypes.Structure):
            for path, inner, size in fields(ctype, prefix + name + "."):
                yield path, offset + inner, size
