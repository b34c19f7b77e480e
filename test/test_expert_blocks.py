# Owner(s): ["module: moe"]
"""The two GEMM forms of the fused CPU expert kernels (torch_moe._native._expert_blocks): the
rule that picks them, and both forms against the reference loop and each other, forward and
backward, with padding, biases, fused gate/up, non-contiguous weights and experts without rows."""

import itertools
import subprocess
import sys
import threading

import torch
from torch.testing._internal.common_utils import instantiate_parametrized_tests, parametrize, \
    run_tests, TestCase

import torch_moe  # noqa: F401
from torch_moe import _refs
from torch_moe._native import _expert_blocks as blocks_mod
from torch_moe._native._expert_blocks import plan_blocks

ops = torch.ops.torch_moe


def _bounds(counts):
    bounds, start = [], 0
    for g, c in enumerate(counts):
        if c:
            bounds.append((g, start, start + c))
        start += c
    return bounds


class _RestoresForm(TestCase):
    def setUp(self):
        super().setUp()
        self.addCleanup(blocks_mod.set_form, blocks_mod.get_form())


class TestPlan(_RestoresForm):
    def setUp(self):
        super().setUp()
        blocks_mod.set_form("auto")  # the rule under test

    def _check_cover(self, bounds, plan):
        # every group once, in slot order; blocks contiguous
        self.assertEqual([grp for b in plan for grp in b.groups], bounds)
        for b in plan:
            self.assertEqual((b.start, b.end), (b.groups[0][1], b.groups[-1][2]))

    def test_balanced_small_groups_batch(self):
        counts = [30 + (g * 7) % 5 for g in range(64)]  # 30 .. 34 rows each
        bounds = _bounds(counts)
        plan = plan_blocks(bounds, "cpu")
        self._check_cover(bounds, plan)
        # batched, but for a tail too short to be worth a batched block of its own
        if not plan[-1].batched:
            self.assertLess(plan[-1].end - plan[-1].start, blocks_mod.BATCH_MIN_BLOCK_ROWS)
            plan = plan[:-1]
        self.assertTrue(plan and all(b.batched for b in plan))
        for b in plan:
            real = b.end - b.start
            self.assertLessEqual(b.num_rows, blocks_mod.BATCH_MAX_PADDING * real)
            self.assertLessEqual(b.num_rows, blocks_mod.BATCH_MAX_BLOCK_ROWS)
            self.assertGreaterEqual(b.num_batched, 2)
            # the slots land on their expert's rows, in order
            expect = torch.cat([torch.arange((g - b.g0) * b.L, (g - b.g0) * b.L + e - s)
                                for g, s, e in b.groups])
            self.assertEqual(b.row_of_slot, expect)

    def test_large_or_skewed_groups_stay_per_group(self):
        for counts in ([600] * 8, [1, 200, 1, 200, 3, 150]):
            bounds = _bounds(counts)
            plan = plan_blocks(bounds, "cpu")
            self._check_cover(bounds, plan)
            self.assertFalse(any(b.batched for b in plan), msg=str(counts))

    def test_short_runs_stay_per_group(self):
        # two small similar experts between large ones: a batched block of 62 padded rows would
        # only add blocks
        bounds = _bounds([30, 31, 600, 30, 31, 600])
        plan = plan_blocks(bounds, "cpu")
        self._check_cover(bounds, plan)
        self.assertFalse(any(b.batched for b in plan))

    def test_default_is_per_group_and_use_form_is_per_thread(self):
        fresh = subprocess.run([sys.executable, "-c", "import torch_moe.cpu as c; "
                                "print(c.get_expert_form())"], capture_output=True, text=True,
                               check=True)
        self.assertEqual(fresh.stdout.strip(), "per_group")
        bounds = _bounds([30 + (g * 7) % 5 for g in range(64)])
        blocks_mod.set_form("per_group")
        self.assertFalse(any(b.batched for b in plan_blocks(bounds, "cpu")))
        with blocks_mod.use_form("batched"):
            self.assertTrue(all(b.batched for b in plan_blocks(bounds, "cpu")))
            seen = []
            other = threading.Thread(target=lambda: seen.append(blocks_mod.get_form()))
            other.start()
            other.join()
            self.assertEqual(seen, ["per_group"])
        self.assertEqual(blocks_mod.get_form(), "per_group")

    def test_forms_can_be_chosen(self):
        bounds = _bounds([30] * 16 + [900, 2, 300, 5])
        blocks_mod.set_form("per_group")
        self.assertFalse(any(b.batched for b in plan_blocks(bounds, "cpu")))
        blocks_mod.set_form("batched")
        plan = plan_blocks(bounds, "cpu")
        self._check_cover(bounds, plan)
        self.assertTrue(all(b.batched for b in plan))
        with self.assertRaisesRegex(ValueError, "one of .*'auto'.* but got 'bmm'"):
            blocks_mod.set_form("bmm")


def _case(T, E, k, D, F, align, fused, bias, dtype, routing, seed=0, noncontiguous=False):
    g = torch.Generator().manual_seed(seed)
    if routing == "balanced":
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    else:  # every other expert unused: runs of experts with gaps
        ids = torch.stack([2 * torch.randperm(E // 2, generator=g)[:k] for _ in range(T)])
    sorted_ids, offs, _ = ops.token_sort(ids, E, align)
    H = 2 * F if fused else F

    def w(*shape):
        if noncontiguous:
            return torch.randn(shape[0], shape[2], shape[1], generator=g,
                               dtype=torch.float64).to(dtype).transpose(1, 2)
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)

    x = torch.randn(T, D, generator=g, dtype=torch.float64).to(dtype)
    topk_weights = torch.rand(T, k, generator=g)
    w1, w2 = w(E, D, H), w(E, F, D)
    w3 = None if fused else w(E, D, F)
    biases = {}
    if bias:
        biases = dict(b1=torch.randn(E, H, generator=g, dtype=torch.float64).to(dtype),
                      b2=torch.randn(E, D, generator=g, dtype=torch.float64).to(dtype))
        if not fused:
            biases["b3"] = torch.randn(E, F, generator=g, dtype=torch.float64).to(dtype)
    activation = "swiglu_oai" if bias else "swiglu"
    return ids, sorted_ids, offs, x, topk_weights, w1, w2, w3, biases, activation


def _run(form, case):
    ids, sorted_ids, offs, x, topk_weights, w1, w2, w3, biases, activation = case
    blocks_mod.set_form(form)
    leaves = [t.detach().requires_grad_() for t in (x, topk_weights, w1, w2)]
    w3_ = w3.detach().requires_grad_() if w3 is not None else None
    b = {n: t.detach().requires_grad_() for n, t in biases.items()}
    out, _ = ops.grouped_ffn(leaves[0], sorted_ids, offs, leaves[1], leaves[2], leaves[3], w3_,
                             activation, 1.702, 7.0, **b)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(9)).to(out.dtype)
    out.backward(grad)
    grads = [t.grad for t in leaves] + ([w3_.grad] if w3_ is not None else [])
    grads += [b[n].grad for n in sorted(b)]
    return out, grads, grad


class TestForms(_RestoresForm):

    @parametrize("fused,bias,align,routing", list(itertools.product(
        (False, True), (False, True), (1, 4), ("balanced", "gaps"))))
    def test_both_forms_match_the_reference_fp64(self, fused, bias, align, routing):
        case = _case(24, 8, 2, 16, 8, align, fused, bias, torch.float64, routing)
        ids, _, _, x, topk_weights, w1, w2, w3, biases, activation = case
        want = _refs.moe_ffn(x, ids, topk_weights, w1, w2, w3, activation_kind=activation,
                             **biases)
        results = {}
        for form in ("per_group", "batched"):
            out, grads, grad = _run(form, case)
            self.assertEqual(out, want, atol=1e-12, rtol=1e-12, msg=form)
            results[form] = grads
        # the reference's gradients, by autograd through the loop
        leaves = [t.detach().requires_grad_() for t in (x, topk_weights, w1, w2)]
        w3_ = w3.detach().requires_grad_() if w3 is not None else None
        b = {n: t.detach().requires_grad_() for n, t in biases.items()}
        _refs.moe_ffn(leaves[0], ids, leaves[1], leaves[2], leaves[3], w3_,
                      activation_kind=activation, **b).backward(grad)
        want_grads = [t.grad for t in leaves] + ([w3_.grad] if w3_ is not None else [])
        want_grads += [b[n].grad for n in sorted(b)]
        for form, grads in results.items():
            for i, (got, exp) in enumerate(zip(grads, want_grads)):
                self.assertEqual(got, exp, atol=1e-11, rtol=1e-11, msg=f"{form}: grad {i}")

    def test_the_forms_agree_in_fp32_and_bf16(self):
        # fp32: within rounding of a different summation order in bmm; bf16: the same arithmetic
        # up to bf16 rounding of the stored pre-activations
        for dtype, tol in ((torch.float32, 2e-5), (torch.bfloat16, 3e-2)):
            for noncontiguous in (False, True):
                case = _case(64, 16, 4, 64, 32, 4, False, True, dtype, "balanced",
                             noncontiguous=noncontiguous)
                out_a, grads_a, _ = _run("per_group", case)
                out_b, grads_b, _ = _run("batched", case)
                scale = out_a.abs().max().item()
                self.assertEqual(out_b, out_a, atol=tol * scale, rtol=tol)
                for i, (ga, gb) in enumerate(zip(grads_a, grads_b)):
                    self.assertEqual(gb, ga, atol=tol * ga.abs().max().item(), rtol=tol,
                                     msg=f"{dtype} grad {i}")

    def test_padding_rows_never_reach_an_output(self):
        # experts without rows inside a batched run have NaN / Inf weights; padding rows of the
        # batched form multiply them, and every output must stay finite and exact
        case = list(_case(24, 8, 2, 16, 8, 4, False, True, torch.float64, "gaps"))
        ids = case[0]
        unused = sorted(set(range(8)) - set(ids.unique().tolist()))
        self.assertTrue(unused)
        for t in (case[5], case[6], case[7], *case[8].values()):
            t[unused] = float("nan")
            t[unused[0]] = float("inf")
        blocks_mod.set_form("batched")
        counts = torch.bincount(ids.flatten(), minlength=8)
        bounds = [(g, 0, int(c)) for g, c in enumerate(counts.tolist()) if c]
        self.assertTrue(any(b.num_batched > len(b.groups) for b in plan_blocks(
            [(g, sum(counts[:g].tolist()), sum(counts[: g + 1].tolist())) for g, _, _ in bounds],
            "cpu")), "no batched block spans an expert without rows")
        out, grads, _ = _run("batched", case)
        self.assertTrue(bool(out.isfinite().all()))
        ref_out, ref_grads, _ = _run("per_group", case)
        self.assertEqual(out, ref_out, atol=1e-12, rtol=1e-12)
        for i, (g, r) in enumerate(zip(grads, ref_grads)):
            # the experts without rows included: their weight gradients are zeros
            self.assertTrue(bool(g.isfinite().all()), msg=f"grad {i}")
            self.assertEqual(g, r, atol=1e-11, rtol=1e-11, msg=f"grad {i}")


class TestExpertFFN(_RestoresForm):
    """``ExpertFFN`` (experts computed on rows the caller gathered, as an expert store does)
    against the fused op in the per-group form: the same pre-activations and, weighted and
    combined by the caller in sorted-slot order, the same output, bit for bit, whichever experts
    share a call and in whatever order."""

    @parametrize("fused,bias,dtype,as_list", list(itertools.product(
        (False, True), (False, True), (torch.float32, torch.bfloat16), (False, True))))
    def test_same_bits_as_the_op(self, fused, bias, dtype, as_list):
        from torch_moe._native.cpu import ExpertFFN
        _, sorted_ids, offs, x, topk_weights, w1, w2, w3, biases, _ = _case(
            11, 8, 3, 16, 8, 1, fused, bias, dtype, "gaps", seed=3)
        blocks_mod.set_form("per_group")
        out, hidden = ops.grouped_ffn(x, sorted_ids, offs, topk_weights, w1, w2, w3, "swiglu",
                                      1.702, 7.0, **biases)
        k, acc = topk_weights.size(1), torch.float32
        rows = torch.div(sorted_ids, k, rounding_mode="floor")
        ends = offs.tolist()
        bounds = {g: (s, e) for g, (s, e) in enumerate(zip([0] + ends[:-1], ends)) if e > s}

        def per_expert(t):
            return [t[g] for g in range(t.size(0))] if as_list and t is not None else t

        ffn = ExpertFFN(per_expert(w1), per_expert(w2), per_expert(w3), "swiglu",
                        **{n: per_expert(b) for n, b in biases.items()}, dtype=dtype)
        o_S = torch.empty(sorted_ids.numel(), x.size(1), dtype=acc)
        h_S = torch.empty_like(hidden)
        experts = list(bounds)
        order = torch.randperm(len(experts), generator=torch.Generator().manual_seed(0)).tolist()
        # calls of one, two and three experts, in a shuffled order
        calls, i = [], 0
        for n in itertools.cycle((1, 2, 3)):
            if i >= len(order):
                break
            calls.append([experts[j] for j in order[i : i + n]])
            i += n
        for call in calls:
            pos = torch.cat([torch.arange(*bounds[g]) for g in call])
            o_p = torch.empty(pos.numel(), x.size(1), dtype=acc)
            h_p = torch.empty(pos.numel(), hidden.size(1), dtype=dtype)
            ffn([(g, bounds[g][1] - bounds[g][0]) for g in call], x[rows[pos]], h_p, o_p)
            o_S[pos], h_S[pos] = o_p, h_p
        self.assertTrue(torch.equal(h_S, hidden))
        w_S = topk_weights.reshape(-1)[sorted_ids].to(acc)
        y = torch.zeros(x.size(0), x.size(1), dtype=acc).index_add_(0, rows, o_S * w_S[:, None])
        self.assertTrue(torch.equal(y.to(dtype), out))


instantiate_parametrized_tests(TestForms)
instantiate_parametrized_tests(TestExpertFFN)

if __name__ == "__main__":
    run_tests()
