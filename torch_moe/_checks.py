"""Input checks shared by the fake and the device kernels of torch_moe ops.

Everything here looks only at metadata (shape, dtype, device), so it runs unchanged under
FakeTensor, ``torch.compile`` and DTensor. Checks that need tensor values (expert ids in range,
monotonic offsets) live in the device kernels. Messages follow ``torch._check`` style: name the
op, say what was expected and what was given.
"""

import torch

# Expert ids are int32 or int64 and group ends int32: no more experts, nor sorted slots, than
# an int32 counts.
MAX_EXPERTS = 2**31 - 1
MAX_SLOTS = 2**31 - 1


def check(cond, message) -> None:
    """``torch._check(cond, message)``, skipped when ``cond`` is the plain ``True`` of an eager
    call: ``torch._check`` sends every condition through the symbolic-shapes machinery, about
    2 us each, and one call of a fused op makes some fifty checks, a fixed cost that small
    (decode) steps pay on every layer. A ``SymBool`` (tracing with dynamic shapes) or ``False``
    goes to ``torch._check``, which records the guard or raises with ``message``."""
    if cond is not True:
        torch._check(cond, message)


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    check(
        t.dtype in FLOAT_DTYPES,
        lambda: f"{op}: expected {name} to be bfloat16, float16, float32 or float64, "
        f"but got {t.dtype}",
    )


def check_index(op: str, name: str, t: torch.Tensor, dtypes=INDEX_DTYPES) -> None:
    names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
    check(
        t.dtype in dtypes, lambda: f"{op}: expected {name} to be {names}, but got {t.dtype}"
    )


def check_dim(op: str, name: str, t: torch.Tensor, dim: int) -> None:
    check(
        t.dim() == dim,
        lambda: f"{op}: expected {name} to be {dim}-D, but got {t.dim()}-D tensor of shape "
        f"{tuple(t.shape)}",
    )


def check_same_dtype(op: str, tensors: dict) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        check(
            t.dtype == first.dtype,
            lambda: f"{op}: expected {name} to have the dtype of {first_name} ({first.dtype}), "
            f"but got {t.dtype}",
        )


def check_same_device(op: str, tensors: dict) -> None:
    items = [(n, t) for n, t in tensors.items() if t is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        check(
            t.device == first.device,
            lambda: f"{op}: expected all tensors on one device, but {first_name} is on "
            f"{first.device} and {name} is on {t.device}",
        )


def check_size(op: str, name: str, t: torch.Tensor, dim: int, expected, what: str) -> None:
    check(
        t.size(dim) == expected,
        lambda: f"{op}: expected {name}.size({dim}) == {what} ({expected}), "
        f"but got {t.size(dim)}",
    )


def check_same_shape(op: str, name: str, t: torch.Tensor, like_name: str, like: torch.Tensor) -> None:
    check(
        t.shape == like.shape,
        lambda: f"{op}: expected {name} to have the shape of {like_name} {tuple(like.shape)}, "
        f"but got {tuple(t.shape)}",
    )


def check_output_mask(op: str, output_mask, outputs: tuple) -> None:
    check(
        len(output_mask) == len(outputs),
        lambda: f"{op}: expected output_mask of length {len(outputs)} (one flag for each of "
        f"{', '.join(outputs)}), but got length {len(output_mask)}",
    )


# The largest row count an output may have: its storage of rows * cols elements of itemsize bytes
# must be addressable (an int64 byte count), or allocation fails with a generic overflow error.
_MAX_BYTES = 2**63 - 1


def check_num_rows(op: str, name: str, rows, cols, itemsize: int) -> None:
    """``rows`` (a size argument) is >= 0 and a [rows, cols] output is addressable."""
    check(rows >= 0, lambda: f"{op}: expected {name} >= 0, but got {rows}")
    limit = _MAX_BYTES // (max(cols, 1) * itemsize)
    check(
        rows <= limit,
        lambda: f"{op}: expected {name} <= {limit} (an output of {name} x {cols} elements of "
        f"{itemsize} bytes must be addressable), but got {rows}",
    )


def check_offs(op: str, offs: torch.Tensor) -> None:
    check_dim(op, "offs", offs, 1)
    check_index(op, "offs", offs, (torch.int32,))


def check_sorted_ids(op: str, sorted_ids: torch.Tensor) -> None:
    check_dim(op, "sorted_ids", sorted_ids, 1)
    check_index(op, "sorted_ids", sorted_ids, (torch.int64,))


# ---------------------------------------------------------------------------------------------
# Per-op metadata checks. Each returns what the fake kernel needs to build its output.
# ---------------------------------------------------------------------------------------------


def check_token_sort(topk_ids: torch.Tensor, num_experts: int, align: int) -> None:
    op = "torch_moe.token_sort"
    check_dim(op, "topk_ids", topk_ids, 2)
    check_index(op, "topk_ids", topk_ids)
    check(
        1 <= num_experts <= MAX_EXPERTS,
        lambda: f"{op}: expected num_experts in [1, {MAX_EXPERTS}], but got {num_experts}",
    )
    check(
        1 <= align <= MAX_SLOTS,
        lambda: f"{op}: expected align in [1, {MAX_SLOTS}], but got {align}",
    )
    k = topk_ids.size(1)
    check(
        k <= num_experts,
        lambda: f"{op}: expected top-k ({k}) <= num_experts ({num_experts}): a token cannot "
        "pick the same expert twice",
    )
    S = token_sort_num_slots(topk_ids.numel(), num_experts, align)
    check(
        S <= MAX_SLOTS,
        lambda: f"{op}: expected the number of sorted slots T * k + num_experts * (align - 1) "
        f"<= {MAX_SLOTS} (offs is int32), but got {S} (num_experts={num_experts}, "
        f"align={align})",
    )


def token_sort_num_slots(num_assignments, num_experts: int, align: int):
    """Static length S of ``sorted_ids``: every group may need up to ``align - 1`` pad slots."""
    return num_assignments + (num_experts * (align - 1) if align > 1 else 0)


def check_permute(x: torch.Tensor, sorted_ids: torch.Tensor, top_k: int) -> None:
    op = "torch_moe.permute"
    check_dim(op, "x", x, 2)
    check_sorted_ids(op, sorted_ids)
    check_same_device(op, {"x": x, "sorted_ids": sorted_ids})
    check(top_k >= 1, lambda: f"{op}: expected top_k >= 1, but got {top_k}")


def check_permute_out(x, sorted_ids, top_k, out) -> None:
    check_permute(x, sorted_ids, top_k)
    op = "torch_moe.permute.out"
    expected = (sorted_ids.size(0), x.size(1))
    check(
        out.shape == expected and out.dtype == x.dtype,
        lambda: f"{op}: expected out of shape {expected} and dtype {x.dtype}, "
        f"but got {tuple(out.shape)} and {out.dtype}",
    )
    check_same_device(op, {"x": x, "out": out})


def check_permute_backward(grad, sorted_ids, top_k, num_tokens) -> None:
    op = "torch_moe.permute_backward"
    check_dim(op, "grad", grad, 2)
    check_float(op, "grad", grad)
    check_sorted_ids(op, sorted_ids)
    check_same_device(op, {"grad": grad, "sorted_ids": sorted_ids})
    check_size(op, "grad", grad, 0, sorted_ids.size(0), "sorted_ids.size(0)")
    check(top_k >= 1, lambda: f"{op}: expected top_k >= 1, but got {top_k}")
    check_num_rows(op, "num_tokens", num_tokens, grad.size(1), grad.dtype.itemsize)


def check_unpermute(y, sorted_ids, topk_weights, op: str = "torch_moe.unpermute") -> None:
    check_dim(op, "y", y, 2)
    check_sorted_ids(op, sorted_ids)
    check_dim(op, "topk_weights", topk_weights, 2)
    check_float(op, "y", y)
    check_float(op, "topk_weights", topk_weights)
    check_same_device(op, {"y": y, "sorted_ids": sorted_ids, "topk_weights": topk_weights})
    check_size(op, "y", y, 0, sorted_ids.size(0), "sorted_ids.size(0)")


def check_unpermute_backward(grad, y, sorted_ids, topk_weights, output_mask) -> None:
    op = "torch_moe.unpermute_backward"
    check_unpermute(y, sorted_ids, topk_weights, op)
    check_dim(op, "grad", grad, 2)
    check_same_dtype(op, {"y": y, "grad": grad})
    check_same_device(op, {"y": y, "grad": grad})
    check_size(op, "grad", grad, 0, topk_weights.size(0), "the number of tokens topk_weights.size(0)")
    check_size(op, "grad", grad, 1, y.size(1), "y.size(1)")
    check_output_mask(op, output_mask, ("grad_y", "grad_topk_weights"))


def check_grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> None:
    op = "torch_moe.grouped_mm"
    check_float(op, "self", a)
    check_same_dtype(op, {"self": a, "mat2": b})
    check_offs(op, offs)
    check_same_device(op, {"self": a, "mat2": b, "offs": offs})
    layout = (a.dim(), b.dim())
    check(
        layout in ((2, 3), (3, 2), (2, 2)),
        lambda: f"{op}: expected (self, mat2) to be 2-D x 3-D, 3-D x 2-D or 2-D x 2-D, but got "
        f"{a.dim()}-D x {b.dim()}-D (use torch.bmm for 3-D x 3-D)",
    )
    check(
        a.size(-1) == b.size(-2),
        lambda: f"{op}: contraction dims differ: self.size(-1) is {a.size(-1)}, "
        f"mat2.size(-2) is {b.size(-2)}",
    )
    if layout == (2, 3):
        check_size(op, "offs", offs, 0, b.size(0), "number of groups mat2.size(0)")
    elif layout == (3, 2):
        check_size(op, "offs", offs, 0, a.size(0), "number of groups self.size(0)")


def grouped_mm_out_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor):
    if a.dim() == 2 and b.dim() == 3:
        return (a.size(0), b.size(2))
    if a.dim() == 3 and b.dim() == 2:
        return (a.size(1), b.size(1))
    return (offs.size(0), a.size(0), b.size(1))


def check_indexed_grouped_mm(
    input, weight, offs, gather_index, scatter_index, scatter_weight, num_out_rows,
    op: str = "torch_moe.indexed_grouped_mm",
):
    """Returns the number of sorted slots S."""
    check_dim(op, "input", input, 2)
    check_dim(op, "weight", weight, 3)
    check_float(op, "input", input)
    check_same_dtype(op, {"input": input, "weight": weight})
    check_offs(op, offs)
    check_same_device(
        op,
        {"input": input, "weight": weight, "offs": offs, "gather_index": gather_index,
         "scatter_index": scatter_index, "scatter_weight": scatter_weight},
    )
    check_size(op, "offs", offs, 0, weight.size(0), "number of experts weight.size(0)")
    check_size(op, "weight", weight, 1, input.size(1), "input.size(1)")
    num_slots = input.size(0)
    if gather_index is not None:
        check_dim(op, "gather_index", gather_index, 1)
        check_index(op, "gather_index", gather_index, (torch.int64,))
        num_slots = gather_index.size(0)
    if scatter_index is not None:
        check_dim(op, "scatter_index", scatter_index, 1)
        check_index(op, "scatter_index", scatter_index, (torch.int64,))
        check_size(op, "scatter_index", scatter_index, 0, num_slots, "the number of sorted slots")
        check(
            num_out_rows >= 0,
            lambda: f"{op}: expected num_out_rows >= 0 when scatter_index is given, "
            f"but got {num_out_rows}",
        )
        # the output is accumulated in fp32 (fp64 for fp64 inputs)
        check_num_rows(op, "num_out_rows", num_out_rows, weight.size(2), 8)
    else:
        check(
            num_out_rows == -1,
            lambda: f"{op}: num_out_rows ({num_out_rows}) is only meaningful with scatter_index",
        )
    if scatter_weight is not None:
        check_dim(op, "scatter_weight", scatter_weight, 1)
        check_float(op, "scatter_weight", scatter_weight)
        check_size(op, "scatter_weight", scatter_weight, 0, num_slots, "the number of sorted slots")
    return num_slots


def check_indexed_grouped_mm_backward(
    grad, input, weight, offs, gather_index, scatter_index, scatter_weight, output_mask
):
    """Returns the number of sorted slots S."""
    op = "torch_moe.indexed_grouped_mm_backward"
    check_dim(op, "grad", grad, 2)
    num_out_rows = grad.size(0) if scatter_index is not None else -1
    S = check_indexed_grouped_mm(
        input, weight, offs, gather_index, scatter_index, scatter_weight, num_out_rows, op
    )
    check_same_dtype(op, {"input": input, "grad": grad})
    check_same_device(op, {"input": input, "grad": grad})
    if scatter_index is None:
        check_size(op, "grad", grad, 0, S, "the number of sorted slots")
    check_size(op, "grad", grad, 1, weight.size(2), "weight.size(2)")
    check_output_mask(op, output_mask, ("grad_input", "grad_weight", "grad_scatter_weight"))
    return S


GATED_ACTIVATIONS = ("swiglu", "geglu", "swiglu_oai")
ACTIVATIONS = GATED_ACTIVATIONS + ("gelu", "relu")
# the outputs of grouped_ffn_backward, one output_mask flag each
GROUPED_FFN_GRADIENTS = ("grad_x", "grad_topk_weights", "grad_w1", "grad_w2", "grad_w3",
                         "grad_b1", "grad_b2", "grad_b3")


def check_grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3, activation,
                      op: str = "torch_moe.grouped_ffn", *, b1=None, b2=None, b3=None):
    """Returns (E, F): the number of experts and the FFN dim."""
    check(
        activation in ACTIVATIONS,
        lambda: f"{op}: expected activation to be one of {ACTIVATIONS}, but got {activation!r}",
    )
    check_dim(op, "x", x, 2)
    check_float(op, "x", x)
    check_sorted_ids(op, sorted_ids)
    check_offs(op, offs)
    check_dim(op, "topk_weights", topk_weights, 2)
    check_float(op, "topk_weights", topk_weights)
    check_dim(op, "w1", w1, 3)
    check_dim(op, "w2", w2, 3)
    check_same_dtype(op, {"x": x, "w1": w1, "w2": w2, "w3": w3})
    check_same_device(
        op, {"x": x, "sorted_ids": sorted_ids, "offs": offs, "topk_weights": topk_weights,
             "w1": w1, "w2": w2, "w3": w3},
    )
    D = x.size(1)
    E = w1.size(0)
    check_size(op, "topk_weights", topk_weights, 0, x.size(0), "the number of tokens x.size(0)")
    check_size(op, "offs", offs, 0, E, "number of experts w1.size(0)")
    check_size(op, "w1", w1, 1, D, "the model dim x.size(1)")
    check_size(op, "w2", w2, 0, E, "number of experts w1.size(0)")
    check_size(op, "w2", w2, 2, D, "the model dim x.size(1)")
    F = w2.size(1)
    gated = activation in GATED_ACTIVATIONS
    if w3 is not None:
        check(gated, lambda: f"{op}: w3 is only used by gated activations, not {activation!r}")
        check_dim(op, "w3", w3, 3)
        check(
            w3.shape == w1.shape,
            lambda: f"{op}: expected w3 to have the shape of w1 {tuple(w1.shape)}, "
            f"but got {tuple(w3.shape)}",
        )
        check_size(op, "w1", w1, 2, F, "the FFN dim w2.size(1)")
    elif gated:
        check_size(op, "w1", w1, 2, 2 * F, "2 * w2.size(1) for a fused gate/up weight")
    else:
        check_size(op, "w1", w1, 2, F, "the FFN dim w2.size(1)")
    check_ffn_biases(op, w1, w3, b1, b2, b3, E, F, D, gated)
    return E, F


def check_ffn_biases(op: str, w1, w3, b1, b2, b3, E: int, F: int, D: int, gated: bool) -> None:
    """The optional expert biases of grouped_ffn: b1 ``[E, F]`` (``[E, 2F]`` with a fused w13),
    b3 ``[E, F]`` (with a separate w3 only), b2 ``[E, D]``, each in the dtype and on the device
    of the weights; any strides."""
    fused = gated and w3 is None
    check(
        b3 is None or w3 is not None,
        lambda: f"{op}: b3 is the bias of the up projection w3, but w3 is None"
        + (" (the bias of a fused gate/up weight is b1 [E, 2F])" if fused else ""),
    )
    width, what = (2 * F, "2F") if fused else (F, "F")
    expected = {"b1": ((E, width), f"[E, {what}]"), "b2": ((E, D), "[E, D]"),
                "b3": ((E, F), "[E, F]")}
    for name, b in (("b1", b1), ("b2", b2), ("b3", b3)):
        if b is None:
            continue
        shape, dims = expected[name]
        check_dim(op, name, b, 2)
        check(
            tuple(b.shape) == shape,
            lambda: f"{op}: expected {name} of shape {dims} = {shape}, but got {tuple(b.shape)}",
        )
    check_same_dtype(op, {"w1": w1, "b1": b1, "b2": b2, "b3": b3})
    check_same_device(op, {"w1": w1, "b1": b1, "b2": b2, "b3": b3})


def check_grouped_ffn_backward(grad, x, sorted_ids, offs, topk_weights, w1, w2, w3, hidden,
                               activation, output_mask, *, b1=None, b2=None, b3=None):
    """Returns (E, F): the number of experts and the FFN dim."""
    op = "torch_moe.grouped_ffn_backward"
    E, F = check_grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3, activation, op,
                             b1=b1, b2=b2, b3=b3)
    check_same_shape(op, "grad", grad, "x", x)
    check_dim(op, "hidden", hidden, 2)
    check_same_dtype(op, {"x": x, "grad": grad, "hidden": hidden})
    check_same_device(op, {"x": x, "grad": grad, "hidden": hidden})
    width = 2 * F if activation in GATED_ACTIVATIONS else F
    check_size(op, "hidden", hidden, 0, sorted_ids.size(0), "sorted_ids.size(0)")
    check_size(op, "hidden", hidden, 1, width, "the width of the pre-activations")
    check_output_mask(op, output_mask, GROUPED_FFN_GRADIENTS)
    return E, F
