"""Glue shared by the python-backend models: input access, error responses (their parameters:
``serve.settings.ModelSettings``).

``pb_utils`` (``triton_python_backend_utils``) only exists inside the Triton stub, so it is passed in, never
imported here; everything else in the serving path is plain, testable Python.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from trtllm_dflash.errors import DFlashError, require


def get(pb_utils, request, name: str, default: Any = None) -> np.ndarray | None:
    """Input ``name`` of ``request`` without its batch dimension, or ``default`` when the optional input is absent."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    if t is None:
        return default
    arr = t.as_numpy()
    return arr[0] if arr.ndim >= 1 and arr.shape[0] == 1 else arr


def scalar(pb_utils, request, name: str, default: Any = None, kind=float) -> Any:
    arr = get(pb_utils, request, name)
    if arr is None:
        return default
    flat = np.asarray(arr).reshape(-1)
    if flat.size != 1:
        raise DFlashError(f"{name}: expected one value, got shape {list(np.asarray(arr).shape)}")
    return kind(flat[0])


class RowView:
    """Row ``row`` of a batched request as a request of its own: in place of ``pb_utils``, its
    ``get_input_tensor_by_name`` answers with that row's slice (batch dimension 1), so code written for one-row
    requests (``get``, ``scalar``) reads it unchanged; everything else is ``pb_utils``'s (the entry models' batches
    of texts, the tensorrt_llm model's batches of token ids)."""

    class _Slice:
        def __init__(self, array: np.ndarray) -> None:
            self._array = array

        def as_numpy(self) -> np.ndarray:
            return self._array

    def __init__(self, pb_utils, row: int, batch: int) -> None:
        self._pb, self._row, self._batch = pb_utils, row, batch

    def get_input_tensor_by_name(self, request, name: str):
        t = self._pb.get_input_tensor_by_name(request, name)
        if t is None:
            return None
        arr = t.as_numpy()
        require(arr.ndim > 0 and arr.shape[0] == self._batch, f"{name} shape", list(arr.shape),
                f"must have the request's batch of {self._batch} rows first", "send one row per prompt")
        return self._Slice(arr[self._row:self._row + 1])

    def __getattr__(self, name: str):
        return getattr(self._pb, name)


def row_views(pb_utils, request, name: str) -> list:
    """One ``pb_utils`` stand-in per row of a request (``RowView``), its batch read from input ``name``; a one-row
    request gets ``pb_utils`` itself."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    batch = t.as_numpy().shape[0] if t is not None and t.as_numpy().ndim else 1
    return [pb_utils] if batch <= 1 else [RowView(pb_utils, b, batch) for b in range(batch)]


def rows(pb_utils, request, name: str, default: Any = None) -> np.ndarray | None:
    """Input ``name`` of ``request`` with its batch dimension (one row per sequence of a coalesced step call)."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else t.as_numpy()


def as_torch(t, copy: bool = False):
    """A pb_utils.Tensor as a torch tensor: a device tensor through DLPack without a copy, a host tensor from its
    numpy view (``copy``: from a copy of it, for a response's outputs, whose buffer the stub may reuse)."""
    import torch

    if not t.is_cpu():
        return torch.from_dlpack(t.to_dlpack())
    return torch.from_numpy(np.array(t.as_numpy()) if copy else t.as_numpy())


def rows_torch(pb_utils, request, name: str, default: Any = None):
    """Input ``name`` as a torch tensor with its batch dimension (``as_torch``)."""
    t = pb_utils.get_input_tensor_by_name(request, name)
    return default if t is None else as_torch(t)


def torch_output(pb_utils, name: str, x) -> Any:
    """An output tensor (leading batch dimension of 1) from a torch tensor: a CUDA tensor leaves through DLPack and
    stays on the device, so the next model of the loop reads it where it was written."""
    return torch_rows_output(pb_utils, name, x.unsqueeze(0))


def torch_rows_output(pb_utils, name: str, x) -> Any:
    """An output tensor from a torch tensor that already has its batch dimension (see ``torch_output``)."""
    import torch.utils.dlpack

    x = x.contiguous()
    if x.is_cuda:
        return pb_utils.Tensor.from_dlpack(name, torch.utils.dlpack.to_dlpack(x))
    return pb_utils.Tensor(name, x.numpy())


def tensor(pb_utils, name: str, array) -> Any:
    """An output tensor with a leading batch dimension of 1."""
    return pb_utils.Tensor(name, np.ascontiguousarray(np.asarray(array)[None]))


def error_response(pb_utils, exc: BaseException):
    """INVALID_ARGUMENT for bad input (DFlashError), the error's own ``triton_code`` where it has one (e.g.
    UNAVAILABLE for an overloaded server), INTERNAL otherwise; the message names the problem."""
    code = pb_utils.TritonError.INVALID_ARG if isinstance(exc, DFlashError) else pb_utils.TritonError.INTERNAL
    code = getattr(pb_utils.TritonError, getattr(exc, "triton_code", ""), code)
    return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(exc), code))
