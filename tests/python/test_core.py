"""The core binding: zero-copy views of torch and NumPy arrays, errors."""

import numpy as np
import pytest

import leanstep

torch = pytest.importorskip("torch")


def test_numpy_view_is_zero_copy():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert leanstep.data_ptr(a) == a.ctypes.data
    assert leanstep.describe(a) == "float32[3, 4] cpu"


def test_torch_strided_bf16_view_is_zero_copy():
    t = torch.zeros(5, 6, dtype=torch.bfloat16)
    v = t[1:, ::2]
    assert leanstep.data_ptr(v) == v.data_ptr()
    assert leanstep.describe(v) == "bfloat16[4, 3] cpu"


@pytest.mark.parametrize(
    "dtype,name",
    [(torch.float32, "float32"), (torch.float16, "float16"), (torch.bfloat16, "bfloat16"),
     (torch.float64, "float64"), (torch.int64, "int64"), (torch.int32, "int32"),
     (torch.bool, "bool"), (torch.uint8, "uint8")],
)
def test_dtypes_map(dtype, name):
    assert leanstep.describe(torch.zeros(2, dtype=dtype)).startswith(name + "[")


def test_read_only_numpy_input_is_accepted():
    a = np.ones(3, dtype=np.float32)
    a.setflags(write=False)
    assert leanstep.describe(a) == "float32[3] cpu"


def test_unsupported_dtype_raises_leanstep_error():
    with pytest.raises(leanstep.Error, match="unsupported DLPack dtype"):
        leanstep.describe(np.zeros(3, dtype=np.complex64))
    assert issubclass(leanstep.Error, ValueError)


def test_read_scalar_counts_a_host_read():
    leanstep.reset_counters()
    assert leanstep.read_scalar(torch.tensor([2.5])) == 2.5
    assert leanstep.counters()["host_reads"] == 1


def test_threads_roundtrip():
    n = leanstep.num_threads()
    leanstep.set_num_threads(1)
    assert leanstep.num_threads() == 1
    leanstep.set_num_threads(n)
    assert leanstep.num_threads() == n
