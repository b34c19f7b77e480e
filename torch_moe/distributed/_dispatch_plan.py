"""Token-dispatch planning for expert parallelism: where each routed token goes, how many copies.

Layout. ``E`` experts are placed on ``R`` expert-parallel ranks in contiguous blocks of
``G = E // R``: expert ``e`` lives on rank ``e // G``. A source rank holds ``T`` tokens, each
routed to ``k`` distinct experts (``topk_ids [T, k]``).

Counting convention. A *copy* is one token row (``D`` values) placed in the send buffer for a
destination rank. Every destination counts, the source rank itself included: the local copy
still goes through the same permute/pack step, and it is how DeepEP and Megatron-Core count
dispatch volume. To get inter-rank traffic only, drop the source rank's entry of
:func:`send_counts`; under uniform routing that removes a fraction ``1 / R`` of the copies.

* plain dispatch sends one copy per (token, expert) pair: ``k`` copies per token;
* dedup dispatch sends one copy per (token, distinct destination rank); the receiving rank
  fans the row out to its local experts;
* rank-limited routing (DeepSeek-V3's node-limited routing, with groups = ranks) first picks
  the best ``m`` ranks per token and then the top-``k`` experts among those ranks only, so
  dedup dispatch sends at most ``m`` copies per token.

All tensor functions are vectorised and make no host synchronisation; the range of
``topk_ids`` is not validated because that would need one.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from torch_moe.nn.functional import _stable_topk

__all__ = [
    "bytes_per_token",
    "dedup_mask",
    "destination_ranks",
    "expected_copies_per_token",
    "rank_limited_topk",
    "send_counts",
]


def _check_int(name: str, value, low: int = 1) -> None:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
        raise ValueError(f"expected {name} to be an int >= {low}, but got {value!r}")


def _experts_per_rank(num_experts: int, num_ranks: int) -> int:
    _check_int("num_experts", num_experts)
    _check_int("num_ranks", num_ranks)
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"expected num_experts divisible by num_ranks={num_ranks} (expert parallelism "
            f"places the same number of experts on every rank), but got num_experts={num_experts}"
        )
    return num_experts // num_ranks


def _check_k(k: int, num_experts: int) -> None:
    _check_int("k", k)
    if k > num_experts:
        raise ValueError(f"expected k in [1, num_experts={num_experts}] experts per token, but "
                         f"got k={k}")


def _check_max_ranks(max_ranks: int, num_ranks: int, k: int, experts_per_rank: int) -> None:
    _check_int("max_ranks", max_ranks)
    if max_ranks > num_ranks:
        raise ValueError(f"expected max_ranks in [1, num_ranks={num_ranks}], but got "
                         f"max_ranks={max_ranks}")
    if k > max_ranks * experts_per_rank:
        raise ValueError(
            f"expected k <= max_ranks * experts per rank = {max_ranks * experts_per_rank} "
            f"(k experts chosen from max_ranks={max_ranks} ranks of {experts_per_rank}), but "
            f"got k={k}"
        )


def _check_ids(topk_ids: Tensor) -> None:
    if not isinstance(topk_ids, Tensor):
        raise TypeError(f"expected topk_ids to be a Tensor, but got {type(topk_ids).__name__}")
    if topk_ids.dim() != 2:
        raise ValueError(f"expected topk_ids to be 2-D [T, k], but got shape "
                         f"{tuple(topk_ids.shape)}")
    dtype = topk_ids.dtype
    if dtype.is_floating_point or dtype.is_complex or dtype == torch.bool:
        raise ValueError(f"expected topk_ids to be an integer tensor, but got {dtype}")


def destination_ranks(topk_ids: Tensor, num_experts: int, num_ranks: int) -> Tensor:
    """Rank that owns each routed expert.

    Args:
        topk_ids: ``[T, k]`` integer expert ids in ``[0, num_experts)``.
        num_experts: ``E``, divisible by ``num_ranks``.
        num_ranks: ``R``, the expert-parallel degree.

    Returns:
        ``[T, k]`` int64 rank ids, ``topk_ids // (E // R)``.
    """
    _check_ids(topk_ids)
    experts_per_rank = _experts_per_rank(num_experts, num_ranks)
    return torch.div(topk_ids.long(), experts_per_rank, rounding_mode="floor")


def dedup_mask(dest: Tensor) -> Tensor:
    """Mark the first occurrence of each (token, destination rank) pair.

    Args:
        dest: ``[T, k]`` destination ranks, e.g. from :func:`destination_ranks`.

    Returns:
        ``[T, k]`` bool; ``True`` where ``dest[t, j]`` differs from every ``dest[t, i]`` with
        ``i < j``. Selecting ``dest[mask]`` gives each (token, rank) pair exactly once.
    """
    if not isinstance(dest, Tensor):
        raise TypeError(f"expected dest to be a Tensor, but got {type(dest).__name__}")
    if dest.dim() != 2:
        raise ValueError(f"expected dest to be 2-D [T, k], but got shape {tuple(dest.shape)}")
    if dest.dtype.is_floating_point or dest.dtype.is_complex or dest.dtype == torch.bool:
        raise ValueError(f"expected dest to be an integer tensor, but got {dest.dtype}")
    k = dest.shape[1]
    # Pairwise comparison within each token is O(T * k^2), cheaper than an O(T * R) one-hot
    # table for the k << R of expert parallelism, and needs no sort.
    same = dest.unsqueeze(2) == dest.unsqueeze(1)  # [T, k(j), k(i)]
    earlier = torch.ones(k, k, dtype=torch.bool, device=dest.device).tril(-1)  # i < j
    return ~(same & earlier).any(dim=2)


def send_counts(topk_ids: Tensor, num_experts: int, num_ranks: int, dedup: bool) -> Tensor:
    """Token copies one source rank places in the send buffer of every destination rank.

    Args:
        topk_ids: ``[T, k]`` expert ids of the source rank's tokens.
        num_experts: ``E``.
        num_ranks: ``R``.
        dedup: count one copy per (token, distinct rank) instead of one per (token, expert).

    Returns:
        ``[R]`` int64 counts. The source rank's own entry is included (see the module note);
        the sum is ``T * k`` without dedup.
    """
    dest = destination_ranks(topk_ids, num_experts, num_ranks)
    flat = dest.reshape(-1)
    if dedup:
        ones = dedup_mask(dest).reshape(-1).long()
    else:
        ones = torch.ones_like(flat)
    # scatter_add_ rather than bincount: bincount reads the max value on the host.
    counts = torch.zeros(num_ranks, dtype=torch.long, device=topk_ids.device)
    return counts.scatter_add_(0, flat, ones)


def rank_limited_topk(
    scores: Tensor,
    k: int,
    num_ranks: int,
    max_ranks: int,
    rank_score_topk: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Top-``k`` experts per token, chosen only among the experts of its best ``max_ranks`` ranks.

    This is DeepSeek-V3's node-limited (group-limited) routing with one group per
    expert-parallel rank: a rank's score is the sum of its ``rank_score_topk`` highest expert
    scores, the ``max_ranks`` highest-scoring ranks are kept, and the ``k`` highest expert
    scores among the kept ranks' experts are selected. Ties go to the lowest rank, then the
    lowest expert index.

    The ranks are the groups of the router's group-limited routing
    (:func:`torch_moe.nn.functional.route` with ``num_groups=R``, ``topk_groups=m``), and the
    selection uses its tie-breaking top-k, but not its masking of the other groups, for two
    reasons. A group's score there is always the sum of its top ``min(2, E / R)`` scores, while
    ``rank_score_topk`` is a parameter here. And the router masks the experts of the other
    groups with ``-inf`` before its top-k, which the router's finite scores keep apart from
    every kept expert; ``scores`` here may hold genuine ``-inf`` (experts ruled out by the
    caller), which would tie with the masked experts and could hand a token an expert of a rank
    outside its best ``max_ranks``. Gathering the kept ranks' experts instead keeps the bound of
    ``max_ranks`` ranks per token, the traffic bound of deduplicated dispatch, for any scores.

    Args:
        scores: ``[T, E]`` routing scores (higher is better), e.g. sigmoid affinities plus the
            load-balancing bias in DeepSeek-V3.
        k: experts per token, at most ``max_ranks * E // R``.
        num_ranks: ``R``, dividing ``E``.
        max_ranks: ``m``, the most ranks a token may be sent to, ``1 <= m <= R``.
        rank_score_topk: how many expert scores make up a rank's score; defaults to
            ``min(2, E // R)`` as in DeepSeek-V3.

    Returns:
        ``(topk_ids, topk_weights)``, both ``[T, k]``: int64 expert ids in decreasing order of
        score, and the scores at those ids (not normalised; callers that need gates summing to
        one normalise them).
    """
    if not isinstance(scores, Tensor):
        raise TypeError(f"expected scores to be a Tensor, but got {type(scores).__name__}")
    if scores.dim() != 2:
        raise ValueError(f"expected scores to be 2-D [T, E], but got shape "
                         f"{tuple(scores.shape)}")
    if not scores.dtype.is_floating_point:
        raise ValueError(f"expected floating scores, but got {scores.dtype}")
    num_tokens, num_experts = scores.shape
    _check_k(k, num_experts)
    experts_per_rank = _experts_per_rank(num_experts, num_ranks)
    _check_max_ranks(max_ranks, num_ranks, k, experts_per_rank)
    if rank_score_topk is None:
        rank_score_topk = min(2, experts_per_rank)
    _check_int("rank_score_topk", rank_score_topk)
    if rank_score_topk > experts_per_rank:
        raise ValueError(
            f"expected rank_score_topk in [1, {experts_per_rank}] (the experts per rank), but "
            f"got rank_score_topk={rank_score_topk}"
        )

    per_rank = scores.reshape(num_tokens, num_ranks, experts_per_rank)
    # The order of the summed terms does not matter, so plain topk is fine here.
    rank_scores = per_rank.topk(rank_score_topk, dim=-1).values.sum(dim=-1)  # [T, R]
    _, ranks = _stable_topk(rank_scores, max_ranks)  # [T, m]
    # Gathering the kept ranks in increasing rank order makes the candidates' positions follow
    # global expert order, so the stable sort below breaks ties by the lowest expert id. It
    # also avoids masking the other ranks with -inf, which would tie with genuine -inf scores.
    ranks = ranks.sort(dim=-1).values
    idx = ranks.unsqueeze(-1).expand(num_tokens, max_ranks, experts_per_rank)
    candidates = per_rank.gather(1, idx).reshape(num_tokens, max_ranks * experts_per_rank)
    weights, pos = _stable_topk(candidates, k)  # [T, k]
    # Candidate position p is local expert p % G of the (p // G)-th kept rank.
    kept_rank = ranks.gather(1, torch.div(pos, experts_per_rank, rounding_mode="floor"))
    topk_ids = kept_rank * experts_per_rank + pos % experts_per_rank
    return topk_ids, weights


def expected_copies_per_token(
    num_experts: int,
    k: int,
    num_ranks: int,
    dedup: bool,
    max_ranks: int | None = None,
) -> float:
    """Copies per token dispatched under uniform random routing, counted as in the module note.

    Uniform routing: each token's ``k`` experts are a uniformly random ``k``-subset of the
    ``E`` experts (without replacement).

    * plain: exactly ``k``.
    * dedup: the number of ranks hit is ``sum_r 1[rank r hit]``. Rank ``r`` is missed when all
      ``k`` experts fall among the other ``E - G`` experts, which has probability
      ``C(E - G, k) / C(E, k)``. By linearity of expectation over the ``R`` ranks::

          E[copies] = R * (1 - C(E - G, k) / C(E, k)),   G = E / R

      (``C(n, k) = 0`` for ``k > n``, so the expectation is ``R`` when every rank must be hit.)
    * rank-limited (``max_ranks=m`` with ``dedup=True``): routing is no longer a uniform
      subset, so the value returned is the bound ``min(k, m)``, not an expectation. Every
      token reaches at most ``m`` ranks by construction and at most ``k`` because it has ``k``
      experts. The exact mean under i.i.d. scores depends on the order statistics of the rank
      scores and has no simple closed form. Measured with i.i.d. uniform scores (see
      ``benchmarks/dispatch.py``): for ``k > m`` the mean sits just under ``m`` (a kept rank
      nearly always supplies one of the top ``k``, having been kept for its top experts;
      3.9998 of 4 for E=256, k=8, R=64), and for ``k <= m`` it stays at or below the
      unconstrained dedup expectation. Without dedup rank limiting changes nothing: ``k``
      copies.

    Raises:
        ValueError: ``k`` outside ``[1, E]``, ``E`` not divisible by ``R``, ``max_ranks``
            outside ``[1, R]`` or too small to hold ``k`` experts, or ``min(k, E / R)`` above
            a million (the expectation takes that many terms).
    """
    _check_k(k, num_experts)
    experts_per_rank = _experts_per_rank(num_experts, num_ranks)
    if max_ranks is not None:
        _check_max_ranks(max_ranks, num_ranks, k, experts_per_rank)
    if not dedup:
        return float(k)
    if max_ranks is not None:
        return float(min(k, max_ranks))
    return num_ranks * (1.0 - _missed_probability(num_experts, experts_per_rank, k))


# Up to this many terms the binomial ratio is exact (integers, one rounding); up to the second
# bound it is a compensated sum of logarithms (relative error ~1e-15 per term); beyond it the
# call would take seconds, and no routing has that many experts per token and per rank.
_EXACT_TERMS = 1024
_MAX_TERMS = 10**6


def _missed_probability(num_experts: int, experts_per_rank: int, k: int) -> float:
    """``C(E - G, k) / C(E, k)``: none of a token's ``k`` distinct experts is among the ``G`` of
    a given rank. Equal to ``C(E - k, G) / C(E, G)``, so it takes ``min(k, G)`` terms."""
    E = num_experts
    if k > E - experts_per_rank:
        return 0.0
    m, other = min(k, experts_per_rank), max(k, experts_per_rank)
    if m <= _EXACT_TERMS:
        return math.comb(E - other, m) / math.comb(E, m)
    if m > _MAX_TERMS:
        raise ValueError(f"expected min(k, num_experts / num_ranks) <= {_MAX_TERMS} for the "
                         f"expectation, but got {m}")
    # prod_{i < m} (E - other - i) / (E - i) = prod (1 - other / (E - i))
    return math.exp(math.fsum(math.log1p(-other / (E - i)) for i in range(m)))


def bytes_per_token(
    num_experts: int,
    k: int,
    num_ranks: int,
    hidden_dim: int,
    dtype_bytes: int,
    dedup: bool,
    max_ranks: int | None = None,
) -> float:
    """Dispatch payload per token in bytes: ``expected_copies_per_token(...) * D * dtype_bytes``.

    Only the activation rows are counted; routing metadata (expert ids, gates) and the
    scales of quantised payloads are not. With ``max_ranks`` the value is an upper bound,
    as in :func:`expected_copies_per_token`.
    """
    _check_int("hidden_dim", hidden_dim)
    if not (isinstance(dtype_bytes, numbers.Real) and not isinstance(dtype_bytes, bool)
            and math.isfinite(dtype_bytes) and dtype_bytes > 0):
        raise ValueError(f"expected dtype_bytes to be a finite number > 0, but got "
                         f"{dtype_bytes!r}")
    copies = expected_copies_per_token(num_experts, k, num_ranks, dedup, max_ranks)
    return copies * hidden_dim * dtype_bytes
