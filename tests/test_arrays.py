"""describe() and same_framework() on NumPy arrays and framework look-alikes (CPU only)."""

from __future__ import annotations

import numpy as np
import pytest

from fa2cupy.arrays import ArrayInfo, describe, same_framework


class _Dtype:
    """Stands in for torch.dtype (str() -> 'torch.bfloat16')."""

    def __init__(self, text):
        self.text = text

    def __str__(self):
        return self.text


class _FakeArray:
    """Base of the look-alikes: shape, dtype and the DLPack methods."""

    def __init__(self, shape, dtype, device=(2, 0), strides=None):
        self.shape = tuple(shape)
        self.dtype = dtype
        self._device = device
        self._strides = strides

    def __dlpack__(self, stream=None):  # never called by describe()
        raise AssertionError("describe() must not export the array")

    def __dlpack_device__(self):
        return self._device


class FakeTensor(_FakeArray):
    """Looks like torch.Tensor to framework detection."""

    def stride(self):
        return self._strides


FakeTensor.__module__ = "torch"


class FakeParameter(FakeTensor):
    """A subclass living elsewhere, like torch.nn.Parameter or a user subclass."""


FakeParameter.__module__ = "mylib.layers"


class FakeJaxArray(_FakeArray):
    pass


FakeJaxArray.__module__ = "jaxlib._jax"


class FakeTracer:
    """A jax tracer: no buffer, hence no __dlpack__."""


FakeTracer.__module__ = "jax._src.interpreters.partial_eval"


class OtherLibArray(_FakeArray):
    pass


OtherLibArray.__module__ = "tensorflow.python.framework.ops"


def torch_like(shape, dtype="torch.float16", device=(2, 0), strides=None):
    if strides is None:
        strides = tuple(np.zeros(shape, dtype=np.int8).strides)
    return FakeTensor(shape, _Dtype(dtype), device, strides)


def test_numpy_contiguous():
    x = np.zeros((2, 3, 4, 8), dtype=np.float16)
    info = describe(x, "q")
    assert info == ArrayInfo("q", "numpy", (2, 3, 4, 8), "float16", (96, 32, 8, 1), ("cpu", 0))
    assert info.device_str == "cpu"


def test_numpy_strided_view_reports_element_strides():
    base = np.zeros((2, 4, 3, 16), dtype=np.float32)  # (b, h, s, d)
    x = base.transpose(0, 2, 1, 3)  # (b, s, h, d) view
    info = describe(x, "k")
    assert info.shape == (2, 3, 4, 16)
    assert info.strides == (192, 16, 48, 1)
    sliced = base[:, ::2, :, 1::2]
    assert describe(sliced, "v").strides == (192, 96, 16, 2)


def test_numpy_negative_and_zero_strides():
    x = np.zeros((3, 4), dtype=np.float16)[::-1]
    assert describe(x, "q").strides == (-4, 1)
    y = np.broadcast_to(np.zeros(4, dtype=np.float16), (3, 4))
    assert describe(y, "q").strides == (0, 1)


def test_numpy_bfloat16_dtype_name():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    x = np.zeros((1, 2, 1, 4), dtype=ml_dtypes.bfloat16)
    assert describe(x, "q").dtype == "bfloat16"


def test_numpy_misaligned_strides_rejected():
    # A 3-byte step is a whole number of uint8 elements but not of float16 ones.
    raw = np.zeros(64, dtype=np.uint8)
    x8 = np.ndarray(shape=(3,), dtype=np.uint8, buffer=raw.data, strides=(3,))
    x16 = np.ndarray(shape=(3,), dtype=np.float16, buffer=raw.data, strides=(3,))
    assert describe(x8, "ok").strides == (3,)
    with pytest.raises(ValueError, match=r"^q has byte strides \(3,\) that are not multiples"):
        describe(x16, "q")


def test_torch_like_metadata():
    t = torch_like((2, 5, 4, 64), "torch.bfloat16", device=(2, 1), strides=(1280, 64, 320, 1))
    info = describe(t, "q")
    assert info.framework == "torch"
    assert info.dtype == "bfloat16"
    assert info.strides == (1280, 64, 320, 1)
    assert info.device == ("cuda", 1)
    assert info.device_str == "cuda:1"


def test_torch_subclass_detected_through_mro():
    p = FakeParameter((1, 1, 1, 8), _Dtype("torch.float16"), (2, 0), (8, 8, 8, 1))
    assert describe(p, "q").framework == "torch"


def test_device_type_may_be_an_enum():
    import enum

    class DLDeviceType(enum.IntEnum):
        kDLCUDA = 2

    t = torch_like((1, 1, 1, 8), device=(DLDeviceType.kDLCUDA, 0))
    assert describe(t, "q").device == ("cuda", 0)


def test_cuda_managed_counts_as_cuda():
    t = torch_like((1, 1, 1, 8), device=(13, 2))
    assert describe(t, "q").device == ("cuda", 2)


def test_jax_like_gets_c_contiguous_strides():
    x = FakeJaxArray((2, 3, 4, 5), np.dtype(np.float16), device=(2, 0))
    info = describe(x, "v")
    assert info.framework == "jax"
    assert info.dtype == "float16"
    assert info.strides == (60, 20, 5, 1)


@pytest.mark.parametrize(
    "value,tname",
    [([1.0, 2.0], "list"), (None, "NoneType"), (3.0, "float"), (np.float32(1.0), "float32")],
)
def test_non_arrays_rejected(value, tname):
    with pytest.raises(TypeError) as err:
        describe(value, "q")
    assert str(err.value) == (
        f"q must be an array with __dlpack__ (CuPy, PyTorch, JAX or NumPy), got {tname}"
    )


def test_jax_tracer_hint():
    with pytest.raises(TypeError, match=r"^k must be an array with __dlpack__.*jax\.jit"):
        describe(FakeTracer(), "k")


def test_other_library_rejected():
    x = OtherLibArray((1,), np.dtype(np.float16))
    with pytest.raises(TypeError, match=r"^v is a tensorflow\..*OtherLibArray; fa2cupy accepts"):
        describe(x, "v")


def test_unsupported_device_rejected():
    t = torch_like((1, 1, 1, 8), device=(10, 0))  # ROCm
    with pytest.raises(TypeError, match=r"^q is on a ROCm device; fa2cupy works on CUDA"):
        describe(t, "q")
    t = torch_like((1, 1, 1, 8), device=(3, 0))  # pinned host
    with pytest.raises(TypeError, match=r"^k is on a CUDA pinned host device"):
        describe(t, "k")


def test_device_query_failure_rejected():
    class Sharded(FakeJaxArray):
        def __dlpack_device__(self):
            raise ValueError("array is sharded over 2 devices")

    with pytest.raises(TypeError, match=r"^q \(Sharded\) could not report its device"):
        describe(Sharded((1,), np.dtype(np.float16)), "q")


def _info(name, framework, device=("cuda", 0)):
    return ArrayInfo(name, framework, (1, 1, 1, 8), "float16", (8, 8, 8, 1), device)


def test_same_framework_ok():
    infos = [_info("q", "torch"), _info("k", "torch"), _info("v", "torch")]
    assert same_framework(infos) == "torch"
    infos = [_info(n, "numpy", ("cpu", 0)) for n in "qkv"]
    assert same_framework(infos) == "numpy"


def test_same_framework_device_mismatch():
    infos = [_info("q", "cupy", ("cuda", 0)), _info("k", "cupy", ("cuda", 1))]
    with pytest.raises(ValueError) as err:
        same_framework(infos)
    assert str(err.value) == "k is on cuda:1 but q is on cuda:0; all arrays must be on one device"


def test_same_framework_mixed_frameworks():
    with pytest.raises(ValueError, match=r"^v is a JAX array but q is a PyTorch tensor; all arrays"):
        same_framework([_info("q", "torch"), _info("k", "torch"), _info("v", "jax")])


@pytest.mark.parametrize("host_first", [True, False])
def test_same_framework_host_numpy_with_device_array(host_first):
    host = _info("k", "numpy", ("cpu", 0))
    dev = _info("q", "cupy", ("cuda", 0))
    infos = [host, dev] if host_first else [dev, host]
    with pytest.raises(ValueError, match=r"^k is a host NumPy array but q is a CuPy array on cuda:0"):
        same_framework(infos)


def test_same_framework_cpu_torch_tensor():
    infos = [_info("q", "torch", ("cpu", 0)), _info("k", "torch", ("cpu", 0))]
    with pytest.raises(ValueError, match=r"^q is a PyTorch tensor on the CPU.*q\.cuda\(\)"):
        same_framework(infos)


def test_describe_then_same_framework_end_to_end():
    q = torch_like((1, 2, 2, 8), device=(2, 0))
    k = torch_like((1, 2, 2, 8), device=(2, 1))
    with pytest.raises(ValueError, match="^k is on cuda:1 but q is on cuda:0"):
        same_framework([describe(q, "q"), describe(k, "k")])
