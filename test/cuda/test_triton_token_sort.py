# Owner(s): ["module: moe"]
"""The Triton kernels of ``torch_moe::token_sort`` (:mod:`torch_moe._triton.token_sort`).

* Interpreter (``TRITON_INTERPRET=1``, a subprocess per check, see ``_interpreter.py``): the
  kernel entry :func:`token_sort` on CPU tensors must equal the CPU op bit for bit (values and
  dtypes of ``sorted_ids``, ``offs``, ``tokens_per_expert``) for random ids, empty experts, all
  assignments on one expert, one expert, no tokens, padding (``align`` 1, 2, 16, 32), int32 and
  int64 ids, strided ids, and block sizes and program caps under which several blocks and several
  programs hold assignments of one expert (where a sort that is not stable across blocks would
  show). Out-of-range ids raise.
* Tracing (no interpreter): the CUDA kernel on fake CUDA tensors gives the fake kernel's shapes,
  dtypes and strides without launching anything, and ``aot_export_module`` captures the
  ``triton_kernel_wrapper_functional`` nodes, whose mutation analysis must find that the kernels
  write their internal buffers only (never the ids).
* On a GPU (``TestTritonTokenSortCUDA``): the public op on CUDA tensors against the CPU op at
  realistic sizes (64 K assignments, 64 to 256 experts), and under CUDA graph capture.
"""

import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA
from torch.testing._internal.common_utils import TestCase, parametrize, run_tests

from _interpreter import deterministic, requires_triton, run_check, use_sm90_target

import torch_moe  # noqa: F401  (registers torch.ops.torch_moe)


def _assert_same(actual, expected, what: str) -> None:
    names = ("sorted_ids", "offs", "tokens_per_expert")
    for name, a, e in zip(names, actual, expected):
        assert a.dtype == e.dtype and a.shape == e.shape, (what, name, a.dtype, e.dtype, a.shape)
        assert torch.equal(a.cpu(), e.cpu()), f"{what}: {name}\n{a}\nexpected\n{e}"


def _cases(g: torch.Generator):
    """``(what, topk_ids, E, align)``: the routings every check sorts."""
    def rand(T, k, E, dtype=torch.int64):
        # k distinct experts per token, as a router picks them
        return torch.rand(T, E, generator=g).argsort(1)[:, :k].to(dtype)

    skewed = rand(24, 2, 4)
    skewed[:18, 0] = 2  # most assignments on expert 2, in every block
    cases = [
        ("random", rand(16, 2, 4), 4, 1),
        ("random int32", rand(16, 3, 4, torch.int32), 4, 1),
        ("random align 2", rand(13, 2, 4), 4, 2),
        ("random align 16", rand(16, 2, 4), 4, 16),
        ("random align 32 int32", rand(11, 3, 4, torch.int32), 4, 32),
        ("skewed", skewed, 4, 1),
        ("skewed align 16", skewed, 4, 16),
        ("all on one expert", torch.full((16, 1), 1), 4, 1),
        ("all on one expert align 16", torch.full((16, 1), 3, dtype=torch.int32), 4, 16),
        ("empty experts", rand(16, 2, 2) * 3, 6, 1),  # experts 1, 2, 4, 5 empty
        ("empty experts align 16", rand(9, 2, 2) * 3 + 1, 6, 16),  # 0, 2, 3, 5 empty
        ("one expert", torch.zeros(14, 1, dtype=torch.int64), 1, 1),
        ("one expert align 32", torch.zeros(14, 1, dtype=torch.int32), 1, 32),
        ("no tokens", torch.empty(0, 2, dtype=torch.int64), 4, 1),
        ("no tokens align 16", torch.empty(0, 2, dtype=torch.int32), 4, 16),
        ("strided ids", rand(16, 4, 4)[:, ::2], 4, 1),
        ("transposed ids align 16", rand(2, 16, 16).t(), 16, 16),
    ]
    return cases


# ---------------------------------------------------------------------------------------------
# Runs in the subprocess (TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------


def _check_token_sort() -> None:
    from torch_moe._triton.token_sort import token_sort

    g = torch.Generator().manual_seed(0)
    # (block, max_programs): one block per program; blocks of 16 in separate programs; several
    # blocks walked by one program (its cursors advance block by block); and, with three blocks
    # or more, a mix of both (two programs, the first walking two blocks)
    for what, ids, E, align in _cases(g):
        expected = torch.ops.torch_moe.token_sort(ids, E, align)
        layouts = [(None, None), (16, None), (16, 1)] + [(16, 2)] * (ids.numel() > 32)
        for block, max_programs in layouts:
            actual = token_sort(ids, E, align, block=block, max_programs=max_programs)
            _assert_same(actual, expected, f"{what}, block={block}, max_programs={max_programs}")
    # deterministic mode fills fresh memory (sorted_ids starts empty when align == 1): every slot
    # must be written
    with deterministic():
        for what, ids, E, align in _cases(g)[:2]:
            expected = torch.ops.torch_moe.token_sort(ids, E, align)
            _assert_same(token_sort(ids, E, align, block=16), expected, f"{what}, deterministic")
    # through the public entry of the CUDA kernel
    from torch_moe._triton import cuda_kernel

    ids = _cases(g)[3][1]
    _assert_same(
        cuda_kernel("token_sort")(ids, 4, 16), torch.ops.torch_moe.token_sort(ids, 4, 16), "op"
    )


def _check_out_of_range_raises() -> None:
    from torch_moe._triton.token_sort import token_sort

    for bad in (4, -1, 2**40):
        ids = torch.tensor([[0, 1], [2, bad]])
        try:
            token_sort(ids, 4)
        except RuntimeError as e:
            assert "expected topk_ids values in [0, 4)" in str(e), str(e)
        else:
            raise AssertionError(f"expert id {bad} of 4 experts did not raise")

    # Without the check (on a GPU it fires asynchronously, after the kernels ran), the kernels
    # clamp invalid ids into [0, E): they sort the clamped ids and write nothing out of bounds.
    from torch_moe._triton import token_sort as T

    T.assert_async = lambda condition, message: None
    ids = torch.tensor([[0, 7], [-3, 1], [2, 2**40], [3, -1]])
    for align in (1, 4):
        expected = torch.ops.torch_moe.token_sort(ids.clamp(0, 3), 4, align)
        _assert_same(T.token_sort(ids, 4, align, block=16), expected, f"clamped, align {align}")


# ---------------------------------------------------------------------------------------------
# Runs in the subprocess (no interpreter)
# ---------------------------------------------------------------------------------------------


def _check_fake_cuda() -> None:
    from torch._functorch.aot_autograd import aot_export_module
    from torch._higher_order_ops.triton_kernel_wrap import triton_kernel_wrapper_functional
    from torch._subclasses.fake_tensor import FakeTensorMode

    from torch_moe._meta_registrations import token_sort_meta
    from torch_moe._triton import cuda_kernel
    from torch_moe._triton import token_sort as T

    def launched(*args, **kwargs):
        raise AssertionError("a Triton kernel was launched on fake tensors")

    for kernel in (T._count_kernel, T._scatter_kernel):
        kernel.run = launched

    def meta(t):
        return t.shape, t.dtype, t.stride(), t.device

    # 1. Shapes, dtypes, strides and device of the fake kernel; data-dependent ops (a host read,
    # nonzero, bincount) would raise under the fake mode.
    with FakeTensorMode():
        for T_, k, E, align, dtype in [
            (4096, 8, 256, 1, torch.int64), (4096, 8, 256, 32, torch.int32),
            (0, 2, 64, 16, torch.int64), (300, 1, 1, 1, torch.int32),
            (8, 4, 2**23, 1, torch.int32),  # more experts than the table cap: one program
        ]:
            ids = torch.empty(T_, k, dtype=dtype, device="cuda")
            actual = cuda_kernel("token_sort")(ids, E, align)
            expected = token_sort_meta(ids, E, align)
            assert [meta(a) for a in actual] == [meta(e) for e in expected], (T_, k, E, align)

    # 2. Graph capture: the kernels are functional wrapper nodes in the AOT graph.
    class Sort(torch.nn.Module):
        def forward(self, ids):
            return torch.ops.torch_moe._triton_token_sort(ids, 8, 16)

    with FakeTensorMode():
        ids = torch.empty(64, 2, dtype=torch.int64)
    targets = [n.target for n in aot_export_module(Sort(), (ids,), trace_joint=False)[0]
               .graph.nodes if n.op == "call_function"]
    assert targets.count(triton_kernel_wrapper_functional) == 2, targets

    # 3. With a GPU target for the Triton frontend (a stub driver), the mutation analysis must
    # find that the kernels write their buffers only: a write of the ids would make Inductor
    # clone them.
    use_sm90_target()
    gm = aot_export_module(Sort(), (ids,), trace_joint=False)[0]
    clones = sorted(
        tuple(n.kwargs["tensors_to_clone"])
        for n in gm.graph.nodes
        if n.target is triton_kernel_wrapper_functional
    )
    assert clones == [("count_ptr",), ("cursor_ptr", "out_ptr")], clones


# ---------------------------------------------------------------------------------------------
# The tests (parent process)
# ---------------------------------------------------------------------------------------------


@requires_triton
class TestTritonTokenSort(TestCase):
    def _run(self, check: str, interpret: bool) -> None:
        run_check(self, "test_triton_token_sort", check, interpret=interpret)

    def test_token_sort_interpreted(self):
        self._run("_check_token_sort", interpret=True)

    def test_out_of_range_raises_interpreted(self):
        self._run("_check_out_of_range_raises", interpret=True)

    def test_fake_cuda(self):
        self._run("_check_fake_cuda", interpret=False)


@requires_triton
class TestTritonTokenSortDevice(TestCase):
    """On a GPU: the public op (its CUDA kernel is the Triton one) against the CPU op."""

    def _routing(self, T, k, E, dtype, skew: bool):
        g = torch.Generator().manual_seed(T * 1000 + E)
        if not skew:
            return torch.randint(0, E, (T, k), generator=g, dtype=dtype)
        # the last quarter of the experts empty, and a popular expert
        ids = torch.randint(0, E * 3 // 4, (T, k), generator=g)
        ids[: T // 2, 0] = 1
        return ids.to(dtype)

    @onlyCUDA
    @parametrize("E", [64, 128, 256])
    @parametrize("align", [1, 16, 32])
    def test_matches_cpu(self, device, E, align):
        for T, k in [(8192, 8), (16384, 4), (1, 1), (0, 2)]:
            for dtype in (torch.int32, torch.int64):
                for skew in (False, True):
                    ids = self._routing(T, k, E, dtype, skew)
                    actual = torch.ops.torch_moe.token_sort(ids.to(device), E, align)
                    expected = torch.ops.torch_moe.token_sort(ids, E, align)
                    _assert_same(actual, expected, f"T={T} k={k} {dtype} skew={skew}")

    @onlyCUDA
    def test_all_on_one_expert(self, device):
        ids = torch.full((65536, 1), 7, dtype=torch.int32)
        for align in (1, 32):
            actual = torch.ops.torch_moe.token_sort(ids.to(device), 128, align)
            _assert_same(actual, torch.ops.torch_moe.token_sort(ids, 128, align), "one expert")

    @onlyCUDA
    def test_many_experts(self, device):
        # more experts than the table cap allows programs for: each program walks many blocks
        from torch_moe._triton.token_sort import token_sort

        g = torch.Generator().manual_seed(1)
        ids = torch.randint(0, 5000, (40000, 2), generator=g)
        expected = torch.ops.torch_moe.token_sort(ids, 5000, 16)
        with torch.cuda.device(device):
            actual = token_sort(ids.to(device), 5000, 16, max_programs=7)
        _assert_same(actual, expected, "max_programs=7")

    @onlyCUDA
    def test_cuda_graph_capture(self, device):
        ids = self._routing(8192, 8, 256, torch.int64, skew=False).to(device)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            torch.ops.torch_moe.token_sort(ids, 256, 16)  # compiles the kernels off the capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = torch.ops.torch_moe.token_sort(ids, 256, 16)
        ids.copy_(self._routing(8192, 8, 256, torch.int64, skew=True))
        graph.replay()
        torch.cuda.synchronize()
        _assert_same(out, torch.ops.torch_moe.token_sort(ids.cpu(), 256, 16), "graph replay")

    @onlyCUDA
    def test_compile_fullgraph(self, device):
        # Inductor compiles the kernels as user-defined Triton kernels in its generated code
        torch._dynamo.reset()
        ids = self._routing(4096, 8, 128, torch.int32, skew=True)

        def sort(ids):
            return torch.ops.torch_moe.token_sort(ids, 128, 32)

        actual = torch.compile(sort, fullgraph=True)(ids.to(device))
        _assert_same(actual, sort(ids), "compiled")


instantiate_device_type_tests(TestTritonTokenSortDevice, globals(), only_for="cuda")

if __name__ == "__main__":
    run_tests()
