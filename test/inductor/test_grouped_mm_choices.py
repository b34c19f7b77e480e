# Owner(s): ["module: inductor"]
"""The choices the ``grouped_mm`` lowering offers Inductor's autotuning on CPU.

``a [M, K] x b [G, K, N]`` under ``mode="max-autotune"``: the per-group kernel and the padded
``bmm`` (:mod:`torch_moe._inductor.padded_bmm`). Each is checked on its own against eager, in
eager and forced under ``torch.compile``: values, rows past ``offs[-1]`` exactly zero, NaN in a
real row reaching no other group, errors. Then the autotuning itself, with fresh Inductor caches
(``torch._inductor.test_case.TestCase``): both choices benchmarked under max-autotune, on valid
``offs``, and none for the other layouts or without max-autotune.

``grouped_ffn`` under max-autotune: the fused kernel in its per-group and batched expert GEMM
forms, each returning one buffer that the lowering views as ``out`` and ``hidden``: each form
forced (compiled == eager in that form, bit for bit, the kernel in its form whatever the
process's), both benchmarked on a valid balanced routing, symbolic token counts, a compiled
training step, and no autotuning without max-autotune.
"""

import contextlib
import copy
import re

import torch
from torch._dynamo.utils import counters
from torch._inductor import config
from torch._inductor import select_algorithm
from torch._inductor.test_case import TestCase, run_tests
from torch._inductor.utils import run_and_get_code
from torch.testing import FileCheck
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize

import torch_moe  # noqa: F401
import torch_moe.cpu
import torch_moe.nn
from torch_moe._inductor import ffn_forms, padded_bmm
from torch_moe._native import _expert_blocks as expert_blocks
from torch_moe._inductor.padded_bmm import grouped_mm_padded_bmm

ops = torch.ops.torch_moe

PER_GROUP = "torch_moe_grouped_mm"
PADDED_BMM = "torch_moe_grouped_mm_padded_bmm"


def reference(a, b, offs):
    """One matmul per group in fp64, zeros past offs[-1], rounded once."""
    out = torch.zeros(a.size(0), b.size(2), dtype=torch.float64)
    start = 0
    for g, end in enumerate(offs.tolist()):
        out[start:end] = a[start:end].double() @ b[g].double()
        start = end
    return out.to(a.dtype)


def problem(M, K, N, ends, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=g).to(dtype)
    b = torch.randn(len(ends), K, N, generator=g).to(dtype)
    return a, b, torch.tensor(ends, dtype=torch.int32)


@contextlib.contextmanager
def per_group_calls():
    """The calls the padded bmm kernel makes of the per-group kernel (its fallback)."""
    calls = []
    per_group = padded_bmm.native_cpu.grouped_mm

    def spy(*args):
        calls.append(args)
        return per_group(*args)

    padded_bmm.native_cpu.grouped_mm = spy
    try:
        yield calls
    finally:
        padded_bmm.native_cpu.grouped_mm = per_group


def message(fn, *args) -> str:
    try:
        fn(*args)
    except RuntimeError as e:
        return str(e)
    raise AssertionError("accepted the input")


class TestPaddedBmmKernel(TestCase):
    """The padded bmm kernel called directly, against the per-group kernel and the reference."""

    @parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
    def test_equals_per_group(self, dtype):
        # empty groups first, in the middle and last, rows past offs[-1], groups of 1 to 8 rows
        for ends in ([0, 4, 4, 8, 12, 16], [5, 6, 12, 12], [7, 8, 16], [4, 8, 12]):
            a, b, offs = problem(17, 12, 10, ends, dtype)
            with per_group_calls() as calls:
                out = grouped_mm_padded_bmm(a, b, offs)
            self.assertEqual(calls, [])
            tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else {}
            self.assertEqual(out, reference(a, b, offs), **tol)
            # against the per-group kernel, which computes in the same dtype and rounds once:
            # summation-order noise, at most one ulp of the output dtype
            ulp = {torch.float32: 1e-5, torch.float64: 1e-12, torch.bfloat16: 1e-2}[dtype]
            self.assertEqual(out, ops.grouped_mm(a, b, offs), atol=ulp, rtol=ulp)
            self.assertEqual(out[ends[-1]:], torch.zeros(17 - ends[-1], 10, dtype=dtype),
                             atol=0, rtol=0)

    def test_nan_stays_in_its_row(self):
        # NaN in row 4 (group 1) and in rows past offs[-1]: group 1's row 4 is NaN, nothing else
        a, b, offs = problem(12, 8, 6, [3, 6, 9])
        a[4] = float("nan")
        a[10] = float("inf")
        with per_group_calls() as calls:
            out = grouped_mm_padded_bmm(a, b, offs)
        self.assertEqual(calls, [])
        nan_rows = out.isnan().any(1).nonzero().flatten().tolist()
        self.assertEqual(nan_rows, [4])
        self.assertEqual(out[9:], torch.zeros(3, 6), atol=0, rtol=0)
        clean = a.clone()
        clean[4], clean[10] = 0, 0
        keep = torch.ones(12, dtype=torch.bool)
        keep[4] = False
        self.assertEqual(out[keep], reference(clean, b, offs)[keep])

    def test_no_rows_and_empty_dims(self):
        for M, K, N, ends in ((0, 4, 5, [0, 0]), (6, 4, 5, [0, 0]), (6, 0, 5, [2, 6]),
                              (6, 4, 0, [2, 6])):
            a, b, offs = problem(M, K, N, ends)
            self.assertEqual(grouped_mm_padded_bmm(a, b, offs), reference(a, b, offs),
                             atol=0, rtol=0)

    def test_skewed_groups_take_the_per_group_kernel(self):
        # one group of 30 rows among 8: a padded bmm would compute 240 rows for 32
        a, b, offs = problem(32, 8, 8, [1, 31, 31, 31, 31, 31, 31, 32])
        self.assertGreater(8 * 30, padded_bmm.MAX_PADDED_ROWS_PER_ROW * 32)
        with per_group_calls() as calls:
            out = grouped_mm_padded_bmm(a, b, offs)
        self.assertEqual(len(calls), 1)
        self.assertEqual(out, reference(a, b, offs))

    def test_errors_equal_per_group(self):
        a, b, _ = problem(10, 4, 3, [2, 5, 9])
        for ends in ([2, 1, 9], [2, 5, 11], [-1, 5, 9]):
            offs = torch.tensor(ends, dtype=torch.int32)
            expected = message(ops.grouped_mm, a, b, offs)
            with self.assertRaisesRegex(RuntimeError, re.escape(expected)):
                grouped_mm_padded_bmm(a, b, offs)
        with self.assertRaisesRegex(RuntimeError, re.escape(
                message(ops.grouped_mm, a, b, torch.tensor([2, 5], dtype=torch.int32)))):
            grouped_mm_padded_bmm(a, b, torch.tensor([2, 5], dtype=torch.int32))


class _AutotuneTestCase(TestCase):
    """Fresh counters and Dynamo state per test; ``self.benchmarked`` lists each autotuned
    selection as ``(name, sorted choice names)``."""

    def setUp(self):
        super().setUp()
        counters.clear()
        torch._dynamo.reset()
        self.benchmarked = []
        select_algorithm.add_feedback_saver(
            lambda timings, name, *rest: self.benchmarked.append(
                (name, sorted(c.name for c in timings))))

    def tearDown(self):
        select_algorithm.clear_feedback_savers()
        super().tearDown()


class TestGroupedMMChoices(_AutotuneTestCase):
    @parametrize("choice", [PER_GROUP, PADDED_BMM])
    def test_each_choice_forced(self, choice):
        # NaN in a row of group 0 and past offs[-1]; an empty group; compiled == eager
        a, b, offs = problem(26, 16, 12, [5, 5, 11, 18], seed=1)
        a[2], a[23] = float("nan"), float("nan")
        f = lambda a, b, offs: ops.grouped_mm(a, b, offs) * 2
        with config.patch({"max_autotune": True,
                           "test_configs.autotune_choice_name_regex": f"^{choice}$"}):
            out, (code,) = run_and_get_code(torch.compile(f), a, b, offs)
        FileCheck().check(f"extern_kernels.{choice}(").run(code)
        other = PADDED_BMM if choice == PER_GROUP else PER_GROUP
        FileCheck().check_not(f"extern_kernels.{other}(").run(code)
        self.assertEqual(out, f(a, b, offs), atol=0, rtol=0)
        self.assertEqual(out.isnan().any(1).nonzero().flatten().tolist(), [2])
        self.assertEqual(out[18:], torch.zeros(8, 12), atol=0, rtol=0)

    def test_max_autotune_benchmarks_both(self):
        a, b, offs = problem(48, 32, 24, [6, 6, 20, 30, 40, 44], seed=2)
        f = lambda a, b, offs: ops.grouped_mm(a, b, offs).relu()
        benchmarked_offs = []
        real = padded_bmm.native_cpu._group_bounds

        def record(op, offs, *args):
            benchmarked_offs.append(offs.tolist())
            return real(op, offs, *args)

        padded_bmm.native_cpu._group_bounds = record
        try:
            out, (code,) = run_and_get_code(torch.compile(f, mode="max-autotune"), a, b, offs)
        finally:
            padded_bmm.native_cpu._group_bounds = real
        self.assertEqual(out, f(a, b, offs))
        self.assertEqual(self.benchmarked, [("torch_moe_grouped_mm", [PER_GROUP, PADDED_BMM])])
        # the benchmark's offs split the 48 rows evenly (Inductor's own integer inputs are zeros)
        self.assertIn([8, 16, 24, 32, 40, 48], benchmarked_offs)
        self.assertEqual(len(re.findall(
            rf"extern_kernels\.({PER_GROUP}|{PADDED_BMM})\(", code)), 1)
        self.assertEqual(counters["torch_moe"]["grouped_mm_lowering"], 1)

    def test_max_autotune_dynamic_rows(self):
        # a symbolic M: the benchmark's offs use its hint; then other M reuse the graph
        f = torch.compile(lambda a, b, offs: ops.grouped_mm(a, b, offs), mode="max-autotune",
                          dynamic=True)
        for M, ends in ((40, [10, 20, 35, 40]), (52, [0, 13, 30, 50])):
            a, b, offs = problem(M, 8, 16, ends, seed=M)
            self.assertEqual(f(a, b, offs), ops.grouped_mm(a, b, offs))
        self.assertEqual(len(self.benchmarked), 1)
        self.assertEqual(self.benchmarked[0][1], [PER_GROUP, PADDED_BMM])

    def test_no_autotuning_elsewhere(self):
        # no max-autotune; and under max-autotune the 3D x 2D and 2D x 2D layouts: one extern call
        a, b, offs = problem(30, 8, 6, [10, 20, 25], seed=3)
        out, (code,) = run_and_get_code(torch.compile(ops.grouped_mm), a, b, offs)
        self.assertEqual(out, ops.grouped_mm(a, b, offs))
        FileCheck().check(f"extern_kernels.{PER_GROUP}(").run(code)
        torch._dynamo.reset()
        a3, b3 = torch.randn(3, 7, 8), torch.randn(8, 30)
        a2, b2 = torch.randn(7, 30), torch.randn(30, 5)
        for x, y in ((a3, b3), (a2, b2)):
            torch._dynamo.reset()
            out, (code,) = run_and_get_code(torch.compile(ops.grouped_mm, mode="max-autotune"),
                                            x, y, offs)
            self.assertEqual(out, ops.grouped_mm(x, y, offs))
            FileCheck().check(f"extern_kernels.{PER_GROUP}(").check_not(PADDED_BMM).run(code)
        self.assertEqual(self.benchmarked, [])


FFN_FORMS = ("per_group", "batched")


def ffn_problem(T=40, k=2, E=6, D=32, F=16, layout="separate", biases=False, seed=0):
    """Arguments of grouped_ffn: a random top-k routing with an empty expert (the last)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])
    sorted_ids, offs, _ = ops.token_sort(ids, E, 1)
    x, tw = torch.randn(T, D, generator=g), torch.rand(T, k, generator=g)
    F1 = 2 * F if layout == "fused" else F
    w1 = torch.randn(E, D, F1, generator=g) / D**0.5
    w2 = torch.randn(E, F, D, generator=g) / F**0.5
    w3 = torch.randn(E, D, F, generator=g) / D**0.5 if layout == "separate" else None
    activation = "relu" if layout == "plain" else "swiglu"
    kwargs = {}
    if biases:
        kwargs = dict(b1=torch.randn(E, F1, generator=g), b2=torch.randn(E, D, generator=g))
        if w3 is not None:
            kwargs["b3"] = torch.randn(E, F, generator=g)
    return (x, sorted_ids, offs, tw, w1, w2, w3, activation), kwargs


@contextlib.contextmanager
def kernel_forms():
    """The expert GEMM form each call of the fused CPU kernel made by an Inductor choice ran in
    (the thread's form when the kernel starts)."""
    forms = []
    real = ffn_forms.native_cpu.grouped_ffn

    def spy(*args, **kwargs):
        forms.append(expert_blocks.get_form())
        return real(*args, **kwargs)

    ffn_forms.native_cpu.grouped_ffn = spy
    try:
        yield forms
    finally:
        ffn_forms.native_cpu.grouped_ffn = real


class TestGroupedFFNChoices(_AutotuneTestCase):
    """grouped_ffn on CPU under max-autotune: the fused kernel in each expert GEMM form, one
    buffer holding both outputs."""

    @parametrize("form", FFN_FORMS)
    @parametrize("layout", ["separate", "fused", "plain"])
    def test_each_choice_forced(self, form, layout):
        # compiled == eager in that form, bit for bit, both outputs (views of one buffer), with
        # and without biases; a consumer of each output
        for biases in (False, True):
            torch._dynamo.reset()
            args, kwargs = ffn_problem(layout=layout, biases=biases, seed=int(biases))

            def f(*a):
                out, hidden = ops.grouped_ffn(*a, **kwargs)
                return out * 2, hidden + 1

            with config.patch({"max_autotune": True, "test_configs.autotune_choice_name_regex":
                               f"^torch_moe_grouped_ffn_{form}"}):
                compiled = torch.compile(f)
                _, (code,) = run_and_get_code(compiled, *args)
            FileCheck().check(f"extern_kernels.torch_moe_grouped_ffn_{form}").run(code)
            # the kernel runs in its form whatever the process's
            with torch_moe.cpu.expert_form("batched" if form == "per_group" else "per_group"):
                with kernel_forms() as forms:
                    got = compiled(*args)
            self.assertEqual(forms, [form])
            with torch_moe.cpu.expert_form(form):
                want = f(*args)
            for g, w in zip(got, want):
                self.assertEqual(g, w, atol=0, rtol=0)

    def test_max_autotune_benchmarks_both_forms(self):
        args, _ = ffn_problem(T=48, k=2, E=6)
        seen = []
        real = ffn_forms.native_cpu.grouped_ffn

        def record(x, sorted_ids, offs, *rest, **kwargs):
            seen.append((sorted_ids.tolist(), offs.tolist()))
            return real(x, sorted_ids, offs, *rest, **kwargs)

        ffn_forms.native_cpu.grouped_ffn = record
        try:
            (out, hidden), (code,) = run_and_get_code(
                torch.compile(ops.grouped_ffn, mode="max-autotune"), *args)
        finally:
            ffn_forms.native_cpu.grouped_ffn = real
        names = sorted(f"torch_moe_grouped_ffn_{form}_w3" for form in FFN_FORMS)
        self.assertEqual(self.benchmarked, [("torch_moe_grouped_ffn", names)])
        # benchmarked on a valid routing of balanced groups (Inductor's own integer inputs are
        # zeros): slot i holds assignment i, 96 slots in groups of 16
        self.assertIn((list(range(96)), [16, 32, 48, 64, 80, 96]), seen)
        self.assertEqual(len(re.findall(r"extern_kernels\.torch_moe_grouped_ffn_\w+\(", code)), 1)
        self.assertEqual(out, ops.grouped_ffn(*args)[0])
        self.assertEqual(hidden, ops.grouped_ffn(*args)[1])

    def test_max_autotune_dynamic_tokens(self):
        # symbolic T and S: the outputs' offsets in the buffer follow them; one benchmark
        f = torch.compile(ops.grouped_ffn, mode="max-autotune", dynamic=True)
        for T in (40, 52):
            args, _ = ffn_problem(T=T, seed=T)
            with torch_moe.cpu.expert_form("per_group"):
                want = ops.grouped_ffn(*args)
            got = f(*args)
            self.assertEqual(got[0], want[0])
            self.assertEqual(got[1], want[1])
        self.assertEqual(len(self.benchmarked), 1)

    def test_training_step_forced_per_group(self):
        # a compiled MoE layer's forward + backward: the forward's buffer-backed `hidden` is
        # what the backward reads. Against eager to fp32 rounding, not bit for bit: Inductor
        # fuses the routing (softmax, top-k, renormalisation) and rounds it its own way
        cfg = torch_moe.nn.MoEConfig(dim=32, hidden_dim=16, num_experts=6, top_k=2)
        torch.manual_seed(0)
        moe = torch_moe.nn.MoE(cfg)
        ref = copy.deepcopy(moe)
        x = torch.randn(2, 20, 32)
        # every choice but the batched form's (the router's GEMMs autotune too)
        with config.patch({"max_autotune": True, "test_configs.autotune_choice_name_regex":
                           "^(?!torch_moe_grouped_ffn_batched)"}):
            y = torch.compile(moe)(x)
            y.square().sum().backward()
        with torch_moe.cpu.expert_form("per_group"):
            y_ref = ref(x)
            y_ref.square().sum().backward()
        self.assertEqual(y, y_ref)
        for (name, p), q in zip(moe.named_parameters(), ref.parameters()):
            self.assertEqual(p.grad, q.grad, msg=name)
        self.assertGreaterEqual(counters["torch_moe"]["grouped_ffn_lowering"], 1)

    def test_no_autotuning_without_max_autotune(self):
        args, _ = ffn_problem(seed=5)
        (out, hidden), (code,) = run_and_get_code(torch.compile(ops.grouped_ffn), *args)
        FileCheck().check("torch.ops.torch_moe.grouped_ffn.default(").check_not(
            "torch_moe_grouped_ffn_").run(code)
        self.assertEqual(out, ops.grouped_ffn(*args)[0], atol=0, rtol=0)
        self.assertEqual(self.benchmarked, [])
        self.assertEqual(counters["torch_moe"]["grouped_ffn_lowering"], 1)


instantiate_parametrized_tests(TestPaddedBmmKernel)
instantiate_parametrized_tests(TestGroupedMMChoices)
instantiate_parametrized_tests(TestGroupedFFNChoices)

if __name__ == "__main__":
    run_tests()
