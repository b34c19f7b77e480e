# Owner(s): ["module: moe"]
"""Dispatch planning for expert parallelism (``torch_moe/distributed/_dispatch_plan.py``).

Simulated ranks only: plans are tensors, no process group is created. Checked:

* measured dedup copies per token under uniform random routing match the closed form;
* dedup never sends more than plain and reaches the same (token, rank) destinations;
* rank-limited routing matches a per-token reference, never exceeds ``m`` ranks per token,
  breaks ties deterministically and sends fewer bytes than plain dispatch;
* 64 and 256 simulated ranks;
* clear errors for impossible configurations.

Run: ``python test/distributed/test_dispatch_plan.py``.
"""

import math

import torch
from torch.testing._internal.common_utils import (
    TestCase,
    instantiate_parametrized_tests,
    parametrize,
    run_tests,
)

from torch_moe.distributed._dispatch_plan import (
    bytes_per_token,
    dedup_mask,
    destination_ranks,
    expected_copies_per_token,
    rank_limited_topk,
    send_counts,
)


def uniform_topk(num_tokens, num_experts, k, seed=0):
    """``[T, k]`` uniformly random k-subsets of the experts (top-k of i.i.d. uniform scores)."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(num_tokens, num_experts, generator=g).topk(k, dim=1).indices


def ranks_hit(dest, num_ranks):
    """``[T, R]`` bool: which ranks each token reaches."""
    hit = torch.zeros(dest.shape[0], num_ranks, dtype=torch.bool)
    return hit.scatter_(1, dest, True)


class TestDispatchPlan(TestCase):
    @parametrize(
        "num_experts,k,num_ranks",
        [(8, 2, 2), (32, 4, 8), (64, 8, 8), (256, 8, 64), (64, 6, 64), (256, 8, 256)],
    )
    def test_dedup_matches_expectation(self, num_experts, k, num_ranks):
        num_tokens = 20000
        ids = uniform_topk(num_tokens, num_experts, k)
        measured = send_counts(ids, num_experts, num_ranks, dedup=True).sum().item() / num_tokens
        expected = expected_copies_per_token(num_experts, k, num_ranks, dedup=True)
        self.assertLess(abs(measured - expected) / expected, 0.01, f"{measured} vs {expected}")
        plain = send_counts(ids, num_experts, num_ranks, dedup=False).sum().item() / num_tokens
        self.assertEqual(plain, expected_copies_per_token(num_experts, k, num_ranks, dedup=False))
        self.assertEqual(plain, k)

    def test_expectation_edge_cases(self):
        # One rank: everything goes to it once.
        self.assertEqual(expected_copies_per_token(16, 4, 1, dedup=True), 1.0)
        # One expert per rank: ranks and experts coincide, nothing to deduplicate.
        self.assertAlmostEqual(expected_copies_per_token(16, 4, 16, dedup=True), 4.0)
        # k > E - G: every rank must be hit.
        self.assertEqual(expected_copies_per_token(8, 7, 4, dedup=True), 4.0)
        # Two ranks of four, k = 2: 1 + P(second expert on the other rank) = 1 + 4/7.
        self.assertAlmostEqual(expected_copies_per_token(8, 2, 2, dedup=True), 1 + 4 / 7)

    @parametrize("num_ranks", [2, 8, 64, 256])
    def test_dedup_same_destinations_fewer_copies(self, num_ranks):
        num_experts, k = 256, 8
        ids = uniform_topk(4096, num_experts, k, seed=1)
        dest = destination_ranks(ids, num_experts, num_ranks)
        mask = dedup_mask(dest)
        plain = send_counts(ids, num_experts, num_ranks, dedup=False)
        dedup = send_counts(ids, num_experts, num_ranks, dedup=True)
        self.assertEqual(plain.shape, (num_ranks,))
        self.assertTrue((dedup <= plain).all())
        self.assertEqual(plain.sum().item(), ids.numel())
        # Same (token, rank) set, and each pair kept exactly once.
        token = torch.arange(ids.shape[0]).unsqueeze(1).expand_as(dest)
        kept_once = torch.zeros(ids.shape[0], num_ranks, dtype=torch.long)
        kept_once.index_put_((token[mask], dest[mask]), torch.ones(()).long(), accumulate=True)
        self.assertEqual(kept_once.bool(), ranks_hit(dest, num_ranks))
        self.assertTrue((kept_once <= 1).all())
        self.assertEqual(dedup, kept_once.sum(0))

    def test_dedup_mask_first_occurrence(self):
        dest = torch.tensor([[3, 1, 3, 1, 0], [2, 2, 2, 2, 2], [0, 1, 2, 3, 4]])
        self.assertEqual(
            dedup_mask(dest),
            torch.tensor(
                [[True, True, False, False, True], [True, False, False, False, False], [True] * 5]
            ),
        )
        self.assertEqual(dedup_mask(torch.empty(0, 4, dtype=torch.long)).shape, (0, 4))

    def test_destination_ranks(self):
        ids = torch.tensor([[0, 7], [8, 31]], dtype=torch.int32)
        self.assertEqual(destination_ranks(ids, 32, 4), torch.tensor([[0, 0], [1, 3]]))

    def _reference_rank_limited(self, scores, k, num_ranks, max_ranks):
        """Per-token loop with Python sorting, ties to the lowest index."""
        num_experts = scores.shape[1]
        g = num_experts // num_ranks
        n_sum = min(2, g)
        ids = []
        for row in scores.tolist():
            rank_score = [
                sum(sorted(row[r * g : (r + 1) * g], reverse=True)[:n_sum])
                for r in range(num_ranks)
            ]
            kept = sorted(range(num_ranks), key=lambda r: (-rank_score[r], r))[:max_ranks]
            cand = [e for r in kept for e in range(r * g, (r + 1) * g)]
            ids.append(sorted(cand, key=lambda e: (-row[e], e))[:k])
        return torch.tensor(ids)

    @parametrize(
        "num_experts,k,num_ranks,max_ranks",
        [(16, 4, 4, 2), (32, 8, 8, 4), (64, 8, 16, 2), (24, 3, 6, 1), (8, 8, 2, 2)],
    )
    def test_rank_limited_matches_reference(self, num_experts, k, num_ranks, max_ranks):
        g = torch.Generator().manual_seed(2)
        # Quantised scores so that ties between experts and between ranks really occur.
        scores = torch.randint(0, 5, (64, num_experts), generator=g).float()
        ids, weights = rank_limited_topk(scores, k, num_ranks, max_ranks)
        self.assertEqual(ids, self._reference_rank_limited(scores, k, num_ranks, max_ranks))
        self.assertEqual(weights, scores.gather(1, ids))

    def test_rank_limited_ties_lowest_index(self):
        scores = torch.zeros(3, 8)
        ids, _ = rank_limited_topk(scores, 3, num_ranks=4, max_ranks=2)
        self.assertEqual(ids, torch.tensor([[0, 1, 2]] * 3))
        # Genuine -inf scores on a kept rank must not be confused with excluded experts.
        scores = torch.full((1, 8), -math.inf)
        scores[0, 7] = 1.0
        ids, _ = rank_limited_topk(scores, 2, num_ranks=4, max_ranks=1, rank_score_topk=1)
        self.assertEqual(ids, torch.tensor([[7, 6]]))
        # ... nor replaced by an excluded rank's expert when top-k needs one of them (masking the
        # excluded ranks with -inf, as the router does, would pick expert 0 of rank 0 here)
        scores = torch.full((1, 12), 0.1)
        scores[0, 9:] = torch.tensor([1.0, 0.9, -math.inf])
        ids, _ = rank_limited_topk(scores, 3, num_ranks=4, max_ranks=1)
        self.assertEqual(ids, torch.tensor([[9, 10, 11]]))

    # With 256 ranks there is one expert per rank, so 8 experts need m >= 8 and rank limiting
    # cannot save anything there.
    @parametrize("num_ranks,max_ranks", [(8, 4), (64, 4), (64, 2), (256, 8)])
    def test_rank_limited_at_most_m_ranks(self, num_ranks, max_ranks):
        num_experts, k, num_tokens = 256, 8, 8192
        g = torch.Generator().manual_seed(3)
        scores = torch.rand(num_tokens, num_experts, generator=g)
        ids, _ = rank_limited_topk(scores, k, num_ranks, max_ranks)
        self.assertEqual(ids.shape, (num_tokens, k))
        # k distinct experts per token.
        self.assertTrue((ids.sort(1).values.diff(dim=1) > 0).all())
        per_token = dedup_mask(destination_ranks(ids, num_experts, num_ranks)).sum(1)
        self.assertLessEqual(per_token.max().item(), max_ranks)
        bound = expected_copies_per_token(
            num_experts, k, num_ranks, dedup=True, max_ranks=max_ranks
        )
        self.assertLessEqual(per_token.float().mean().item(), bound)

        limited = send_counts(ids, num_experts, num_ranks, dedup=True).sum().item()
        plain = send_counts(ids, num_experts, num_ranks, dedup=False).sum().item()
        unlimited_ids = scores.topk(k).indices
        unlimited = send_counts(unlimited_ids, num_experts, num_ranks, dedup=True).sum().item()
        if max_ranks < k:
            self.assertLess(limited, plain)
            self.assertLess(limited, unlimited)
        else:
            self.assertEqual(limited, plain)

    def test_bytes_per_token_deepseek_v3(self):
        # E = 256, k = 8, EP = 64, D = 7168 in bf16.
        plain = bytes_per_token(256, 8, 64, 7168, 2, dedup=False)
        dedup = bytes_per_token(256, 8, 64, 7168, 2, dedup=True)
        limited = bytes_per_token(256, 8, 64, 7168, 2, dedup=True, max_ranks=4)
        self.assertEqual(plain, 8 * 7168 * 2)
        self.assertLess(dedup, plain)
        self.assertEqual(limited, 4 * 7168 * 2)
        self.assertAlmostEqual(dedup / plain, 64 * (1 - math.comb(252, 8) / math.comb(256, 8)) / 8)

    def test_expected_copies_beyond_exact_terms_matches_binomials(self):
        # min(k, G) = 2000 terms: past the exact integer ratio, a sum of logarithms
        E, k, R = 10**7, 2000, 1000
        exact = R * (1 - math.comb(E - E // R, k) / math.comb(E, k))
        self.assertAlmostEqual(expected_copies_per_token(E, k, R, dedup=True), exact, places=9)
        with self.assertRaisesRegex(ValueError, r"expected min\(k, num_experts / num_ranks\) <= "
                                    r"1000000 for the expectation, but got 2000000"):
            expected_copies_per_token(10**12, 2 * 10**6, 10**5, dedup=True)

    def test_errors(self):
        with self.assertRaises(ValueError) as cm:
            expected_copies_per_token(8, 9, 2, dedup=True)
        self.assertExpectedInline(
            str(cm.exception), """expected k in [1, num_experts=8] experts per token, but got k=9"""
        )
        with self.assertRaises(ValueError) as cm:
            send_counts(torch.zeros(4, 2, dtype=torch.long), 10, 4, dedup=True)
        self.assertExpectedInline(
            str(cm.exception),
            """expected num_experts divisible by num_ranks=4 (expert parallelism places the same number of experts on every rank), but got num_experts=10""",  # noqa: B950
        )
        with self.assertRaisesRegex(
                ValueError, r"expected max_ranks in \[1, num_ranks=4\], but got max_ranks=5"):
            rank_limited_topk(torch.rand(4, 16), 2, num_ranks=4, max_ranks=5)
        with self.assertRaisesRegex(
                ValueError, r"expected k <= max_ranks \* experts per rank = 8 .*, but got k=9"):
            rank_limited_topk(torch.rand(4, 16), 9, num_ranks=4, max_ranks=2)
        with self.assertRaisesRegex(
                ValueError, r"expected k in \[1, num_experts=16\] experts per token, but got k=17"):
            rank_limited_topk(torch.rand(4, 16), 17, num_ranks=4, max_ranks=4)
        with self.assertRaisesRegex(
                ValueError, r"expected num_experts divisible by num_ranks=3 .*, but got "
                r"num_experts=16"):
            rank_limited_topk(torch.rand(4, 16), 2, num_ranks=3, max_ranks=1)
        with self.assertRaisesRegex(ValueError, r"expected max_ranks to be an int >= 1, but got 0"):
            expected_copies_per_token(16, 2, 4, dedup=True, max_ranks=0)
        with self.assertRaisesRegex(
                ValueError, r"expected topk_ids to be an integer tensor, but got torch.float32"):
            destination_ranks(torch.zeros(2, 2), 4, 2)


instantiate_parametrized_tests(TestDispatchPlan)

if __name__ == "__main__":
    run_tests()
