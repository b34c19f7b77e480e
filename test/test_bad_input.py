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
            """torch_moe.token_sort: expected align >= 1, but got 0""",
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
            """torch_moe.unpermute: expected each assignment t * k + j at most once in sorted_ids, but one appears 2 times""",
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


if __name__ == "__main__":
    run_tests()
