"""common.engine.host_upload: a step's host arrays cross as one buffer and come back as the arrays they were."""
import numpy as np
import torch

from common.engine.host_upload import upload


def test_each_array_comes_back_with_its_values_dtype_and_shape():
    arrays = [np.arange(5, dtype=np.int64), np.arange(12, dtype=np.int32).reshape(3, 4), [7, 8, 9],
              np.zeros(0, dtype=np.int32), np.asarray([-1, 2**40], dtype=np.int64)]
    out = upload(arrays, torch.device("cpu"))
    assert [t.dtype for t in out] == [torch.int64, torch.int32, torch.int64, torch.int32, torch.int64]
    for tensor, array in zip(out, arrays):
        np.testing.assert_array_equal(tensor.numpy(), np.asarray(array))
        assert tensor.is_contiguous() and tensor.data_ptr() % 16 == 0


def test_an_odd_sized_array_does_not_shift_the_next_one():
    small, big = np.asarray([1, 2, 3], dtype=np.int32), np.asarray([10, 20], dtype=np.int64)  # 12 bytes, then 8-byte
    got_small, got_big = upload([small, big], torch.device("cpu"))
    assert got_small.tolist() == [1, 2, 3] and got_big.tolist() == [10, 20]


def test_nothing_to_upload_gives_empty_tensors():
    (empty,) = upload([[]], torch.device("cpu"))
    assert empty.shape == (0,) and empty.dtype == torch.int64
