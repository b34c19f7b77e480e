"""Runs torch_moe's CUDA code path on fake tensors and fails on anything that would make the host
wait for the GPU.

:class:`CudaPathMode`, entered inside a :class:`~torch._subclasses.fake_tensor.FakeTensorMode`,
sees every op before the fake mode does. A ``torch_moe`` op is not given to its fake kernel (which
would only compute shapes) but run through its CUDA implementation (for the core ops
:func:`torch_moe._triton.cuda_kernel`, for the others the kernel registered for the CUDA dispatch
key), whose ATen ops and Triton launches then reach this mode and the fake mode in turn; the
Triton launches do nothing on fake tensors. Any op that would synchronise raises
:class:`HostSync`:

* an op tagged ``data_dependent_output`` (``_local_scalar_dense``: ``.item()``, ``.tolist()``,
  ``bool(t)``, ``int(t)``) or ``dynamic_output_shape`` (``nonzero``, ``bincount``, ``unique``,
  boolean-mask indexing, ``masked_select``, ``repeat_interleave`` without ``output_size``);
* a copy from a CUDA tensor to the CPU (``.cpu()``, ``.to("cpu")``, ``copy_`` into a CPU tensor).

The fake mode would itself refuse the first two kinds; the mode names them first, so the error
says which op and where.

The fake tensors live on the ``meta`` device and stand for CUDA ones. Fake tensors on ``cuda``
would need no GPU either, but the Python bindings of ``Tensor.__getitem__``, ``__setitem__`` and
``__invert__`` take a device guard of the tensor's device, which a torch built without CUDA cannot
take for ``cuda``. torch_moe's code outside the kernels never tests for CUDA by name: it tests
for the CPU (where a value check may read the host), and takes the device-side branch on ``meta``
as it does on ``cuda``.
"""

import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import torch_moe._triton as cuda_kernels

__all__ = ["HostSync", "CudaPathMode"]

aten = torch.ops.aten
_CUDA_KEYS = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


class HostSync(AssertionError):
    pass


def _overload_key(func) -> str:
    name = func._schema.name.split("::", 1)[1]
    return name if func._overloadname == "default" else f"{name}.{func._overloadname}"


def _indexes_by_integers(func, args) -> bool:
    """``aten.index`` is tagged with a dynamic output shape for its boolean-mask form; indexing by
    integer tensors has the shape of the indices."""
    if func not in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        return False
    return all(i is None or not (i.dtype == torch.bool or i.dtype == torch.uint8) for i in args[1])


def _on_device(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type != "cpu"


def _is_device_to_host_copy(func, args, kwargs) -> bool:
    if func in (aten._to_copy.default, aten.to.device, aten.to.dtype_layout):
        device = kwargs.get("device")
        return _on_device(args[0]) and device is not None and torch.device(device).type == "cpu"
    if func is aten.copy_.default:
        return args[0].device.type == "cpu" and _on_device(args[1])
    return False


class CudaPathMode(TorchDispatchMode):
    """See the module docstring. ``calls`` counts the torch_moe ops run through their CUDA
    implementation, so that a test can check the path it meant to run was taken."""

    def __init__(self):
        super().__init__()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tags = func.tags
        if (torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags) and (
            not _indexes_by_integers(func, args)
        ):
            raise HostSync(f"{func} synchronises the host with the GPU (its output "
                           f"{'values' if torch.Tag.data_dependent_output in tags else 'shape'} "
                           f"depend on tensor data), called from:\n{_caller()}")
        if _is_device_to_host_copy(func, args, kwargs):
            raise HostSync(f"{func} copies a CUDA tensor to the host, called from:\n{_caller()}")
        if func.namespace == "torch_moe":
            key = _overload_key(func)
            if key in cuda_kernels.CUDA_KERNEL_MODULES:
                self.calls[key] += 1
                # back under this mode, so that the kernel's own ops are checked too
                with self:
                    return cuda_kernels.cuda_kernel(key)(*args, **kwargs)
            if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CUDA"):
                self.calls[key] += 1
                with self:
                    return func.redispatch(_CUDA_KEYS, *args, **kwargs)
        return func(*args, **kwargs)


def _caller() -> str:
    frames = [f for f in traceback.extract_stack()[:-2] if "torch/" not in f.filename
              or "torch_moe" in f.filename]
    return "".join(traceback.format_list(frames[-6:]))
