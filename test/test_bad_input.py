# Owner(s): ["module: moe"]
"""Every public entry point rejects bad input with a message that names what was expected and
what was given. Messages are pinned with ``assertExpectedInline`` so changes are seen in review
(``EXPECTTEST_ACCEPT=1`` rewrites them)."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.common_utils import TestCase, run_tests

import torch_moe
from torch_moe.nn.functional import moe_ffn

ops = torch.ops.torch_moe


def i32(*values):
    return torch.tensor(values, dtype=torch.int32)


class TestBadInput(TestCase):
    def message(self, fn, *args, **kwargs):
        with self.assertRaises((RuntimeError, ValueError)) as ctx:
            fn(*args, **kwargs)
        return str(ctx.exception).splitlines()[0]

    # token_sort -------------------------------------------------------------------------------

    def test_token_sort_expert_id_out_of_range(self):
        ids = torch.tensor([[0, 4], [1, 2]])
        self.assertExpectedInline(
            self.message(torch_moe.token_sort, ids, 4),
            """torch_moe.token_sort: expected topk_ids values in [0, 4), but got values in [0, 4]""",
        )

    def test_token_sort_negative_expert_id(self):
        self.assertExpectedInline(
            self.message(torch_moe.token_sort, torch.tensor([[-1], [2]]), 4),
            """torch_moe.token_sort: expected topk_ids values in [0, 4), but got values in [-1, 2]""",
        )

    def test_token_sort_k_greater_than_e(self):
        self.assertExpectedInline(
            self.message(torch_moe.token_sort, torch.zeros(3, 5, dtype=torch.int64), 4),
            """torch_moe.token_sort: expected top-k (5) <= num_experts (4): a token cannot pick the same expert twice""",
        )

    def test_token_sort_float_ids(self):
        self.assertExpectedInline(
            self.message(torch_moe.token_sort, torch.zeros(3, 2), 4),
            """torch_moe.token_sort: expected topk_ids to be int32 or int64, but got torch.float32""",
        )

    def test_token_sort_1d_ids(self):
        self.assertExpectedInline(
            self.message(torch_moe.token_sort, torch.zeros(3, dtype=torch.int64), 4),
            """torch_moe.token_sort: expected topk_ids to be 2-D, but got 1-D tensor of shape (3,)""",
        )

    def test_token_sort_bad_align(self):
        self.assertExpectedInline(
            self.message(torch_moe.token_sort, torch.zeros(3, 1, dtype=torch.int64), 4, 0),
            """torch_moe.token_sort: expected align in [1, 2147483647], but got 0""",
        )

    def test_token_sort_checks_under_fake(self):
        # metadata checks run in the fake kernel too, so tracing fails as early as eager
        with FakeTensorMode():
            msg = self.message(torch_moe.token_sort, torch.empty(3, 5, dtype=torch.int64), 4)
        self.assertIn("expected top-k (5) <= num_experts (4)", msg)

    # permute / unpermute ----------------------------------------------------------------------

    def test_permute_sorted_ids_out_of_range(self):
        self.assertExpectedInline(
            self.message(torch_moe.permute, torch.randn(3, 4), torch.tensor([0, 6, 2]), 2),
            """torch_moe.permute: expected sorted_ids values in [-1, 6) (-1 marks padding), but got values in [0, 6]""",
        )

    def test_permute_int32_sorted_ids(self):
        self.assertExpectedInline(
            self.message(torch_moe.permute, torch.randn(3, 4), i32(0, 1), 1),
            """torch_moe.permute: expected sorted_ids to be int64, but got torch.int32""",
        )

    def test_permute_out_wrong_shape(self):
        self.assertExpectedInline(
            self.message(torch_moe.permute, torch.randn(3, 4), torch.tensor([0, 1]), 1,
                         out=torch.empty(3, 4)),
            """torch_moe.permute.out: expected out of shape (2, 4) and dtype torch.float32, but got (3, 4) and torch.float32""",
        )

    def test_unpermute_row_count(self):
        self.assertExpectedInline(
            self.message(torch_moe.unpermute, torch.randn(5, 4), torch.tensor([0, 1, 2, 3]),
                         torch.rand(2, 2)),
            """torch_moe.unpermute: expected y.size(0) == sorted_ids.size(0) (4), but got 5""",
        )

    def test_unpermute_duplicate_assignment(self):
        self.assertExpectedInline(
            self.message(torch_moe.unpermute, torch.randn(4, 4), torch.tensor([0, 1, 1, 3]),
                         torch.rand(2, 2)),
            """torch_moe.unpermute: expected each assignment t * k + j at most once in sorted_ids, but assignment 1 appears 2 times""",
        )

    # grouped_mm -------------------------------------------------------------------------------

    def test_grouped_mm_offs_not_monotonic(self):
        self.assertExpectedInline(
            self.message(torch_moe.grouped_mm, torch.randn(8, 4), torch.randn(3, 4, 2), i32(4, 2, 8)),
            """torch_moe.grouped_mm: expected offs to be non-decreasing and non-negative, but offs[1] = 2 < offs[0] = 4""",
        )

    def test_grouped_mm_offs_negative(self):
        self.assertExpectedInline(
            self.message(torch_moe.grouped_mm, torch.randn(8, 4), torch.randn(2, 4, 2), i32(-1, 8)),
            """torch_moe.grouped_mm: expected offs to be non-decreasing and non-negative, but offs[0] = -1 < 0""",
        )

    def test_grouped_mm_offs_past_rows(self):
        self.assertExpectedInline(
            self.message(torch_moe.grouped_mm, torch.randn(8, 4), torch.randn(2, 4, 2), i32(4, 9)),
            """torch_moe.grouped_mm: expected offs[-1] <= self.size(0) (8), but got offs[-1] = 9""",
        )

    def test_grouped_mm_int64_offs(self):
        self.assertExpectedInline(
            self.message(torch_moe.grouped_mm, torch.randn(8, 4), torch.randn(2, 4, 2),
                         torch.tensor([4, 8])),
            """torch_moe.grouped_mm: expected offs to be int32, but got torch.int64""",
        )

    def test_grouped_mm_group_count(self):
        self.assertExpectedInline(
            self.message(torch_moe.grouped_mm, torch.randn(8, 4), torch.randn(3, 4, 2), i32(4, 8)),
            """torch_moe.grouped_mm: expected offs.size(0) == number of groups mat2.size(0) (3), but got 2""",
        )

    def test_grouped_mm_contraction_mismatch(self):
        self.assertExpectedInline(
            self.message(torch_moe.grouped_mm, torch.randn(8, 4), torch.randn(2, 5, 2), i32(4, 8)),
            """torch_moe.grouped_mm: contraction dims differ: self.size(-1) is 4, mat2.size(-2) is 5""",
        )

    def test_grouped_mm_3d_3d(self):
        self.assertExpectedInline(
            self.message(torch_moe.grouped_mm, torch.randn(2, 8, 4), torch.randn(2, 4, 2), i32(4, 8)),
            """torch_moe.grouped_mm: expected (self, mat2) to be 2-D x 3-D, 3-D x 2-D or 2-D x 2-D, but got 3-D x 3-D (use torch.bmm for 3-D x 3-D)""",
        )

    def test_grouped_mm_mixed_dtypes(self):
        self.assertExpectedInline(
            self.message(torch_moe.grouped_mm, torch.randn(8, 4), torch.randn(2, 4, 2).double(), i32(4, 8)),
            """torch_moe.grouped_mm: expected mat2 to have the dtype of self (torch.float32), but got torch.float64""",
        )

    def test_grouped_mm_integer_inputs(self):
        self.assertExpectedInline(
            self.message(torch_moe.grouped_mm, torch.ones(8, 4, dtype=torch.int64),
                         torch.ones(2, 4, 2, dtype=torch.int64), i32(4, 8)),
            """torch_moe.grouped_mm: expected self to be bfloat16, float16, float32 or float64, but got torch.int64""",
        )

    def test_grouped_mm_mixed_devices(self):
        self.assertExpectedInline(
            self.message(torch_moe.grouped_mm, torch.randn(8, 4), torch.randn(2, 4, 2, device="meta"),
                         i32(4, 8)),
            """torch_moe.grouped_mm: expected all tensors on one device, but self is on cpu and mat2 is on meta""",
        )

    # indexed_grouped_mm -----------------------------------------------------------------------

    def test_indexed_gather_index_out_of_range(self):
        self.assertExpectedInline(
            self.message(torch_moe.indexed_grouped_mm, torch.randn(3, 4), torch.randn(2, 4, 5),
                         i32(2, 4), gather_index=torch.tensor([0, 1, 3, 2])),
            """torch_moe.indexed_grouped_mm: expected gather_index values in [-1, 3) (-1 marks padding), but got values in [0, 3]""",
        )

    def test_indexed_scatter_without_rows(self):
        self.assertExpectedInline(
            self.message(torch_moe.indexed_grouped_mm, torch.randn(4, 4), torch.randn(2, 4, 5),
                         i32(2, 4), scatter_index=torch.tensor([0, 1, 2, 2])),
            """torch_moe.indexed_grouped_mm: expected num_out_rows >= 0 when scatter_index is given, but got -1""",
        )

    def test_indexed_weight_rows(self):
        self.assertExpectedInline(
            self.message(torch_moe.indexed_grouped_mm, torch.randn(4, 4), torch.randn(2, 3, 5), i32(2, 4)),
            """torch_moe.indexed_grouped_mm: expected weight.size(1) == input.size(1) (4), but got 3""",
        )

    # moe_ffn ----------------------------------------------------------------------------------

    def _ffn_args(self, E=4, D=6, F=3, T=5, k=2):
        return (torch.randn(T, D), torch.randn(T, E).topk(k).indices, torch.rand(T, k),
                torch.randn(E, D, F), torch.randn(E, F, D), torch.randn(E, D, F))

    def test_moe_ffn_unknown_activation(self):
        self.assertExpectedInline(
            self.message(moe_ffn, *self._ffn_args(), activation="silu"),
            """moe_ffn: expected activation to be one of ('swiglu', 'geglu', 'swiglu_oai', 'gelu', 'relu'), but got 'silu'""",
        )

    def test_moe_ffn_expert_id_out_of_range(self):
        x, ids, w, w1, w2, w3 = self._ffn_args()
        ids[2, 1] = 7
        self.assertExpectedInline(
            self.message(moe_ffn, x, ids, w, w1, w2, w3),
            """torch_moe.token_sort: expected topk_ids values in [0, 4), but got values in [0, 7]""",
        )

    def test_moe_ffn_weights_shape(self):
        x, ids, w, w1, w2, w3 = self._ffn_args()
        self.assertExpectedInline(
            self.message(moe_ffn, x, ids, w[:, :1], w1, w2, w3),
            """moe_ffn: expected topk_ids and topk_weights of the same shape [T, k], but got (5, 2) and (5, 1)""",
        )

    def test_moe_ffn_fused_width(self):
        x, ids, w, w1, w2, _ = self._ffn_args()
        self.assertExpectedInline(
            self.message(moe_ffn, x, ids, w, w1, w2),
            """torch_moe.grouped_ffn: expected w1.size(2) == 2 * w2.size(1) for a fused gate/up weight (6), but got 3""",
        )

    def test_moe_ffn_w3_for_ungated(self):
        self.assertExpectedInline(
            self.message(moe_ffn, *self._ffn_args(), activation="relu"),
            """torch_moe.grouped_ffn: w3 is only used by gated activations, not 'relu'""",
        )

    def test_moe_ffn_model_dim(self):
        x, ids, w, w1, w2, w3 = self._ffn_args()
        self.assertExpectedInline(
            self.message(moe_ffn, x[:, :5], ids, w, w1, w2, w3),
            """torch_moe.grouped_ffn: expected w1.size(1) == the model dim x.size(1) (5), but got 6""",
        )

    def test_moe_ffn_dtype_mismatch(self):
        x, ids, w, w1, w2, w3 = self._ffn_args()
        self.assertExpectedInline(
            self.message(moe_ffn, x.bfloat16(), ids, w, w1, w2, w3),
            """torch_moe.grouped_ffn: expected w1 to have the dtype of x (torch.bfloat16), but got torch.float32""",
        )

    def test_moe_ffn_token_count(self):
        x, ids, w, w1, w2, w3 = self._ffn_args()
        self.assertExpectedInline(
            self.message(moe_ffn, x[:4], ids, w, w1, w2, w3),
            """torch_moe.grouped_ffn: expected topk_weights.size(0) == the number of tokens x.size(0) (4), but got 5""",
        )


    # duplicate assignments: rejected by every op that reads sorted_ids, with one message ------

    def _ffn_op_args(self, T=3, k=2, E=2, D=4, F=3):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, D, generator=g)
        w1, w2 = torch.randn(E, D, 2 * F, generator=g), torch.randn(E, F, D, generator=g)
        return x, torch.rand(T, k, generator=g), w1, w2

    def test_duplicate_assignment_everywhere(self):
        x, tw, w1, w2 = self._ffn_op_args()
        sorted_ids = torch.tensor([0, 2, 2, 1, 3, 5])  # assignment 2 twice, 4 missing
        offs = i32(3, 6)
        out, hidden = ops.grouped_ffn(x, torch.arange(6), offs, tw, w1, w2, None)
        y = torch.randn(6, 4)
        calls = {
            "permute": lambda: ops.permute(x, sorted_ids, 2),
            "permute_backward": lambda: ops.permute_backward(y, sorted_ids, 2, 3),
            "unpermute": lambda: ops.unpermute(y, sorted_ids, tw),
            "unpermute_backward": lambda: ops.unpermute_backward(x, y, sorted_ids, tw,
                                                                 [True, True]),
            "grouped_ffn": lambda: ops.grouped_ffn(x, sorted_ids, offs, tw, w1, w2, None),
            "grouped_ffn_backward": lambda: ops.grouped_ffn_backward(
                out, x, sorted_ids, offs, tw, w1, w2, None, hidden, "swiglu", 1.702, 7.0,
                [True] * 8),
        }
        messages = {name: self.message(call) for name, call in calls.items()}
        self.assertExpectedInline("\n".join(f"{n}: {m}" for n, m in messages.items()), """\
permute: torch_moe.permute: expected each assignment t * k + j at most once in sorted_ids, but assignment 2 appears 2 times
permute_backward: torch_moe.permute_backward: expected each assignment t * k + j at most once in sorted_ids, but assignment 2 appears 2 times
unpermute: torch_moe.unpermute: expected each assignment t * k + j at most once in sorted_ids, but assignment 2 appears 2 times
unpermute_backward: torch_moe.unpermute_backward: expected each assignment t * k + j at most once in sorted_ids, but assignment 2 appears 2 times
grouped_ffn: torch_moe.grouped_ffn: expected each assignment t * k + j at most once in sorted_ids, but assignment 2 appears 2 times
grouped_ffn_backward: torch_moe.grouped_ffn_backward: expected each assignment t * k + j at most once in sorted_ids, but assignment 2 appears 2 times""")

    # backward ops: metadata checked by the eager and the fake kernels --------------------------

    def _backward_calls(self, mode=None):
        """(name, call) of backward ops with one mis-shaped argument each."""
        x, tw, w1, w2 = self._ffn_op_args()
        sorted_ids, offs = torch.arange(6), i32(3, 6)
        hidden = torch.randn(6, 6)
        input, weight = torch.randn(6, 4), torch.randn(2, 4, 5)
        conv = (lambda t: mode.from_tensor(t)) if mode is not None else (lambda t: t)
        x, tw, w1, w2, sorted_ids, offs, hidden, input, weight = map(
            conv, (x, tw, w1, w2, sorted_ids, offs, hidden, input, weight))
        ffn = lambda grad, w1_, w2_, hidden_: ops.grouped_ffn_backward(
            grad, x, sorted_ids, offs, tw, w1_, w2_, None, hidden_, "swiglu", 1.702, 7.0,
            [True] * 8)
        return {
            "grouped_ffn_backward_w2_rows": lambda: ffn(x, w1, w2[:, :2], hidden),
            "grouped_ffn_backward_w1_width": lambda: ffn(x, w1[:, :, :4], w2, hidden),
            "grouped_ffn_backward_grad_shape": lambda: ffn(x[:2], w1, w2, hidden),
            "grouped_ffn_backward_hidden_width": lambda: ffn(x, w1, w2, hidden[:, :3]),
            "grouped_ffn_backward_mask_length": lambda: ops.grouped_ffn_backward(
                x, x, sorted_ids, offs, tw, w1, w2, None, hidden, "swiglu", 1.702, 7.0,
                [True] * 3),
            "indexed_grouped_mm_backward_weight": lambda: ops.indexed_grouped_mm_backward(
                conv(torch.randn(6, 5)), input, weight[:, :3], offs, None, None, None,
                [True, True, False]),
            "indexed_grouped_mm_backward_grad": lambda: ops.indexed_grouped_mm_backward(
                conv(torch.randn(6, 3)), input, weight, offs, None, None, None,
                [True, True, False]),
            "unpermute_backward_grad": lambda: ops.unpermute_backward(
                conv(torch.randn(3, 5)), input, sorted_ids, tw, [True, True]),
            "permute_backward_grad_rows": lambda: ops.permute_backward(
                input[:5], sorted_ids, 2, 3),
            "permute_backward_int_grad": lambda: ops.permute_backward(
                sorted_ids.view(6, 1), sorted_ids, 2, 3),
        }

    def test_backward_ops_check_metadata(self):
        eager = {name: self.message(call) for name, call in self._backward_calls().items()}
        with FakeTensorMode() as mode:
            fake = {name: self.message(call) for name, call in self._backward_calls(mode).items()}
        self.assertEqual(fake, eager)
        self.assertExpectedInline("\n".join(f"{n}: {m}" for n, m in eager.items()), """\
grouped_ffn_backward_w2_rows: torch_moe.grouped_ffn_backward: expected w1.size(2) == 2 * w2.size(1) for a fused gate/up weight (4), but got 6
grouped_ffn_backward_w1_width: torch_moe.grouped_ffn_backward: expected w1.size(2) == 2 * w2.size(1) for a fused gate/up weight (6), but got 4
grouped_ffn_backward_grad_shape: torch_moe.grouped_ffn_backward: expected grad to have the shape of x (3, 4), but got (2, 4)
grouped_ffn_backward_hidden_width: torch_moe.grouped_ffn_backward: expected hidden.size(1) == the width of the pre-activations (6), but got 3
grouped_ffn_backward_mask_length: torch_moe.grouped_ffn_backward: expected output_mask of length 8 (one flag for each of grad_x, grad_topk_weights, grad_w1, grad_w2, grad_w3, grad_b1, grad_b2, grad_b3), but got length 3
indexed_grouped_mm_backward_weight: torch_moe.indexed_grouped_mm_backward: expected weight.size(1) == input.size(1) (4), but got 3
indexed_grouped_mm_backward_grad: torch_moe.indexed_grouped_mm_backward: expected grad.size(1) == weight.size(2) (5), but got 3
unpermute_backward_grad: torch_moe.unpermute_backward: expected grad.size(1) == y.size(1) (4), but got 5
permute_backward_grad_rows: torch_moe.permute_backward: expected grad.size(0) == sorted_ids.size(0) (6), but got 5
permute_backward_int_grad: torch_moe.permute_backward: expected grad to be bfloat16, float16, float32 or float64, but got torch.int64""")

    # absurd sizes: an error that names the argument, at once ---------------------------------

    def test_absurd_sizes(self):
        y = torch.randn(4, 3)
        calls = {
            "token_sort_num_experts": lambda: ops.token_sort(torch.zeros(2, 1, dtype=torch.long),
                                                             2**40),
            "token_sort_align": lambda: ops.token_sort(torch.zeros(2, 1, dtype=torch.long), 4,
                                                       2**40),
            "permute_backward_num_tokens": lambda: ops.permute_backward(y, torch.arange(4), 1,
                                                                        2**62),
            "indexed_grouped_mm_num_out_rows": lambda: ops.indexed_grouped_mm(
                y, torch.randn(1, 3, 2), i32(4), None, torch.arange(4), None, 2**62),
        }
        messages = {name: self.message(call) for name, call in calls.items()}
        self.assertExpectedInline("\n".join(f"{n}: {m}" for n, m in messages.items()), """\
token_sort_num_experts: torch_moe.token_sort: expected num_experts in [1, 2147483647], but got 1099511627776
token_sort_align: torch_moe.token_sort: expected align in [1, 2147483647], but got 1099511627776
permute_backward_num_tokens: torch_moe.permute_backward: expected num_tokens <= 768614336404564650 (an output of num_tokens x 3 elements of 4 bytes must be addressable), but got 4611686018427387904
indexed_grouped_mm_num_out_rows: torch_moe.indexed_grouped_mm: expected num_out_rows <= 576460752303423487 (an output of num_out_rows x 2 elements of 8 bytes must be addressable), but got 4611686018427387904""")


class TestCheck(TestCase):
    """``_checks.check``, through which the op checks run: torch._check's result, without its
    cost when the condition holds."""

    def test_raises_like_torch_check(self):
        from torch_moe import _checks

        with self.assertRaisesRegex(RuntimeError, "^op: expected x, but got y$"):
            _checks.check(False, lambda: "op: expected x, but got y")

    def test_true_costs_no_torch_check(self):
        from unittest import mock

        from torch_moe import _checks

        never = mock.Mock(side_effect=AssertionError("message built for a check that holds"))
        with mock.patch.object(torch, "_check", wraps=torch._check) as spy:
            _checks.check(True, never)
            self.assertEqual(spy.call_count, 0)
            # a SymBool (a guard on a traced size) is torch's to record
            from torch.fx.experimental.symbolic_shapes import ShapeEnv

            size = ShapeEnv().create_unbacked_symint()
            _checks.check(size >= 0, lambda: "unused")
            self.assertEqual(spy.call_count, 1)
        never.assert_not_called()


class TestNoRows(TestCase):
    """Valid calls with nothing to read (no tokens, only padding slots) give zeros."""

    def test_unpermute_without_slots(self):
        # T = 3 tokens, none of whose assignments has a slot
        out = ops.unpermute(torch.randn(0, 4), torch.zeros(0, dtype=torch.long), torch.rand(3, 2))
        self.assertEqual(out, torch.zeros(3, 4), atol=0, rtol=0)

    def test_permute_backward_without_slots(self):
        out = ops.permute_backward(torch.randn(0, 4), torch.zeros(0, dtype=torch.long), 2, 3)
        self.assertEqual(out, torch.zeros(3, 4), atol=0, rtol=0)

    def test_permute_backward_through_autograd(self):
        x = torch.randn(0, 4, requires_grad=True)
        out = ops.permute(x, torch.full((5,), -1), 2)
        (grad,) = torch.autograd.grad(out, x, torch.randn(5, 4))
        self.assertEqual(grad, torch.zeros(0, 4), atol=0, rtol=0)

    def test_indexed_grouped_mm_backward_only_padding(self):
        # no input rows, every slot gathers padding; no output rows, every slot scatters padding
        pad = torch.full((4,), -1)
        offs = i32(2, 4)
        input, weight = torch.randn(0, 3), torch.randn(2, 3, 5)
        sw = torch.rand(4)
        out = ops.indexed_grouped_mm(input, weight, offs, pad, pad, sw, 0)
        self.assertEqual(out, torch.zeros(0, 5), atol=0, rtol=0)
        g_in, g_w, g_sw = ops.indexed_grouped_mm_backward(
            torch.randn(0, 5), input, weight, offs, pad, pad, sw, [True, True, True])
        self.assertEqual(g_in, torch.zeros(0, 3), atol=0, rtol=0)
        self.assertEqual(g_w, torch.zeros(2, 3, 5), atol=0, rtol=0)
        self.assertEqual(g_sw, torch.zeros(4), atol=0, rtol=0)
        g_in, g_w, g_sw = ops.indexed_grouped_mm_backward(
            torch.randn(4, 5), input, weight, offs, pad, None, sw, [True, True, True])
        self.assertEqual((g_in, g_w, g_sw), (torch.zeros(0, 3), torch.zeros(2, 3, 5),
                                             torch.zeros(4)), atol=0, rtol=0)

    def test_grouped_ffn_no_tokens(self):
        E, D, F = 2, 4, 3
        x, tw = torch.randn(0, D), torch.rand(0, 2)
        w1, w2 = torch.randn(E, D, 2 * F), torch.randn(E, F, D)
        sorted_ids, offs = torch.full((4,), -1), i32(2, 4)
        out, hidden = ops.grouped_ffn(x, sorted_ids, offs, tw, w1, w2, None)
        self.assertEqual(out, torch.zeros(0, D), atol=0, rtol=0)
        self.assertEqual(hidden, torch.zeros(4, 2 * F), atol=0, rtol=0)
        grads = ops.grouped_ffn_backward(torch.randn(0, D), x, sorted_ids, offs, tw, w1, w2, None,
                                         hidden, "swiglu", 1.702, 7.0, [True] * 8)
        expected = (torch.zeros(0, D), torch.zeros(0, 2), torch.zeros(E, D, 2 * F),
                    torch.zeros(E, F, D), torch.zeros(0), torch.zeros(0), torch.zeros(0),
                    torch.zeros(0))
        for got, exp in zip(grads, expected):
            self.assertEqual(got, exp, atol=0, rtol=0)

if __name__ == "__main__":
    run_tests()
