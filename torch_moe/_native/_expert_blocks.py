"""The blocks of the fused CPU expert kernels (``grouped_ffn`` forward and backward): how the
sorted slots are cut into blocks, and in which of two forms each block's GEMMs run.

A block is a run of consecutive non-empty groups (experts). Its elementwise work (gathers,
activation, routing weights, combine) runs once on the block's rows; its GEMMs in one of two
forms:

* per-group: one ``mm`` per expert on the expert's rows, in slot order. Right for large groups,
  where a GEMM call is long enough to use every core on its own.
* batched: the experts ``g0 .. g0 + B - 1`` of the block (those without rows included), each
  given ``L`` rows, ``L`` the block's longest group, the rows past an expert's count being zero
  padding; one ``bmm`` over the ``B`` experts per GEMM. At a few tens of rows per expert a single
  ``mm`` may not keep every core busy and pays its call and packing overhead on little work,
  while ``bmm`` runs the experts side by side: on a 2-core AVX512 machine, GEMMs alone at 32
  rows per expert (D = 1024, F = 256) reach 60-80 GFLOP/s per group and 85-135 batched. On the
  whole fused op the padding rows and the copies into and out of the padded layout take that
  gain back there (``python benchmarks/ops.py --sections ffn --dtypes fp32 --forms
  auto,batched`` times the op in each form).

The default form is per-group (see ``_form``). The rule between them, the ``"auto"`` form
(:func:`plan_blocks`): a run of experts takes the batched form when each of them has at most
:data:`BATCH_MAX_ROWS` rows, its padded rows ``B * L`` are at most :data:`BATCH_MAX_PADDING`
times its real rows and at most :data:`BATCH_MAX_BLOCK_ROWS` (so the block's buffers stay a few
MiB, in cache and below glibc's mmap threshold), at least :data:`BATCH_MIN_BLOCK_ROWS` (a short
run only cuts the slots into more blocks), and it spans at least two experts. Everything else
runs per-group, in blocks of at least ``BLOCK_ROWS`` slots. Skewed routing therefore falls back
to the per-group form by itself; balanced small groups (decode, small micro-batches,
fine-grained experts) batch.

Numerics: the per-group form computes each expert's rows with GEMMs of its own, whatever the
other experts' rows, bit for bit as one ``mm`` per expert. The batched form
computes the same products, but ``bmm`` may sum each dot product in another order than ``mm``
(within fp32 rounding: a relative 1e-6 for K = 1024). Padding rows never reach an output: they
are zero on entry, set to zero after each step whatever the weights hold (NaN, Inf, biases), and
read by no combine.

Row spaces: a per-group block's rows are its slots ``[start, end)`` in order; a batched block's
rows are ``B * L`` padded rows, row ``b * L + j`` being the ``j``-th slot of expert ``g0 + b``.
``row_of_slot [end - start]`` maps between the two.
"""

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Optional

import torch

__all__ = ["Block", "plan_blocks", "FORMS", "set_form", "get_form", "use_form", "BLOCK_ROWS",
           "BATCH_MAX_ROWS", "BATCH_MAX_PADDING", "BATCH_MAX_BLOCK_ROWS", "BATCH_MIN_BLOCK_ROWS"]

# A per-group block holds at least this many sorted slots: many small experts cost few
# elementwise launches, while the buffers stay a few MiB.
BLOCK_ROWS = 512
# Rows per expert up to which the batched form is considered (bmm's lead closes near 256 rows).
BATCH_MAX_ROWS = 256
# Padded rows at most this many times the real rows: the padding's flops are wasted.
BATCH_MAX_PADDING = 1.25
# Padded rows of one batched block at most: buffers of [rows, D] stay a few MiB.
BATCH_MAX_BLOCK_ROWS = 1024
# Padded rows of one batched block at least: a short run cuts the slots into more blocks, each
# paying the elementwise calls' fixed cost, for little GEMM time saved.
BATCH_MIN_BLOCK_ROWS = 256

# "auto": the rule above; "per_group": never batched; "batched": every run of at least two
# experts batched whatever its padding and row counts (blocks still of at most
# BATCH_MAX_BLOCK_ROWS padded rows, or two experts).
FORMS = ("auto", "per_group", "batched")
# The default: on the 2-core AVX512 machine measured, the per-group form is as fast as the best
# of the others at every token count from 64 to 8192 at D = 1024, F = 256, E = 64, k = 8
# (within noise, or faster: ``benchmarks/moe_layer.py --forms auto,batched --sweep``), and it
# is the one whose bits do not depend on an expert's neighbours.
_form = "per_group"
# A form set for one thread by use_form(), over the process-wide one: a caller whose result must
# not depend on a neighbour's rows (the expert store's passes) fixes the form for its own kernel
# calls without changing those of other threads.
_local = threading.local()


def _check_form(form: str) -> None:
    if form not in FORMS:
        raise ValueError(f"expected the expert GEMM form to be one of {FORMS}, but got {form!r}")


def set_form(form: str) -> None:
    """Chooses the GEMM form of the fused expert kernels (one of :data:`FORMS`), process-wide."""
    global _form
    _check_form(form)
    _form = form


def get_form() -> str:
    """The form the kernels use in this thread: :func:`use_form`'s, else :func:`set_form`'s."""
    return getattr(_local, "form", None) or _form


@contextlib.contextmanager
def use_form(form: str):
    """Within the block, this thread's fused expert kernels use ``form``; nests, restores the
    previous form on exit (exceptions included)."""
    _check_form(form)
    previous = getattr(_local, "form", None)
    _local.form = form
    try:
        yield
    finally:
        _local.form = previous


@dataclass
class Block:
    """Slots ``[start, end)`` and their groups ``[(g, s, e)]`` (absolute slot bounds); with
    ``num_batched`` > 0, the batched form over experts ``g0 .. g0 + num_batched - 1`` of ``L``
    rows each."""

    start: int
    end: int
    groups: list
    g0: int = 0
    num_batched: int = 0
    L: int = 0
    row_of_slot: Optional[torch.Tensor] = field(default=None, repr=False)

    @property
    def batched(self) -> bool:
        return self.num_batched > 0

    @property
    def num_rows(self) -> int:
        return self.num_batched * self.L if self.batched else self.end - self.start

    # -- moving per-slot values between slot order and the block's rows ----------------------

    def to_rows(self, slot_values: torch.Tensor, fill=0) -> torch.Tensor:
        """Per-slot values ``[end - start, ...]`` laid out on the block's rows (``fill`` in the
        padding rows); the values themselves in the per-group form."""
        if not self.batched:
            return slot_values
        out = slot_values.new_full((self.num_rows, *slot_values.shape[1:]), fill)
        return out.index_copy_(0, self.row_of_slot, slot_values)

    def to_rows_into(self, slot_values: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """:meth:`to_rows` into ``out [num_rows, N]`` (zero padding rows), converting dtype."""
        if not self.batched:
            return out.copy_(slot_values)
        out.zero_()
        if slot_values.dtype != out.dtype:
            slot_values = slot_values.to(out.dtype)
        return out.index_copy_(0, self.row_of_slot, slot_values)

    def to_slots(self, row_values: torch.Tensor) -> torch.Tensor:
        """The rows of the block's slots, in slot order (the padding rows left out)."""
        if not self.batched:
            return row_values
        return row_values.index_select(0, self.row_of_slot)

    def pad_rows(self, pad_slots: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The padding rows of the block: the slots' own padding (``pad_slots``, a bool mask,
        None without any) and, in the batched form, every row past its expert's count, there
        as the indices of those rows (few next to the rows, so zeroing them touches only them).
        """
        if not self.batched:
            return pad_slots
        keep = torch.zeros(self.num_rows, dtype=torch.bool, device=self.row_of_slot.device)
        keep[self.row_of_slot] = True if pad_slots is None else ~pad_slots
        return (~keep).nonzero().squeeze(1)

    # -- GEMMs ---------------------------------------------------------------------------------

    def mm(self, a: torch.Tensor, w, out: torch.Tensor, bias=None) -> torch.Tensor:
        """``out[rows of g] = a[rows of g] @ w(g) (+ bias[g])`` for each expert ``g`` of the
        block. ``a [num_rows, K]``, ``out [num_rows, N]`` contiguous; ``w`` an ``_ExpertWeight``
        accessor: ``w.one(g) [K, N]`` and ``w.run(g0, B) [B, K, N]``; ``bias [E, N]`` or None.
        """
        if not self.batched:
            for g, s, e in self.groups:
                rows = slice(s - self.start, e - self.start)
                b = bias[g] if bias is not None else None
                if b is None:
                    torch.mm(a[rows], w.one(g), out=out[rows])
                else:
                    torch.addmm(b, a[rows], w.one(g), out=out[rows])
            return out
        B, L = self.num_batched, self.L
        a3, out3 = a.view(B, L, a.size(1)), out.view(B, L, out.size(1))
        w3 = w.run(self.g0, B)
        if bias is None:
            torch.bmm(a3, w3, out=out3)
        else:
            torch.baddbmm(bias[self.g0 : self.g0 + B].unsqueeze(1), a3, w3, out=out3)
        return out

    def weight_grad(self, a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, cdt, scratch):
        """``grad[g] = a[rows of g]^T @ b[rows of g]`` for each expert of the block, computed in
        ``cdt``. ``a [num_rows, K]``, ``b [num_rows, N]``; ``grad [E, K, N]`` in any strides
        and dtype; ``scratch(shape)`` gives a contiguous ``cdt`` buffer."""
        if not self.batched:
            for g, s, e in self.groups:
                rows = slice(s - self.start, e - self.start)
                dst = grad[g]
                if dst.dtype == cdt:
                    torch.mm(a[rows].t(), b[rows], out=dst)
                else:
                    dst.copy_(torch.mm(a[rows].t(), b[rows], out=scratch(dst.shape)))
            return
        B, L = self.num_batched, self.L
        a3 = a.view(B, L, a.size(1)).transpose(1, 2)
        b3 = b.view(B, L, b.size(1))
        dst = grad[self.g0 : self.g0 + B]
        # bmm into a strided or differently typed destination falls to a slow path: compute
        # into a contiguous buffer and copy
        if dst.dtype == cdt and dst.is_contiguous():
            torch.bmm(a3, b3, out=dst)
        else:
            dst.copy_(torch.bmm(a3, b3, out=scratch((B, a.size(1), b.size(1)))))

    def row_sums(self, t: torch.Tensor, out: torch.Tensor, acc) -> None:
        """``out[g] = sum of t over the rows of g`` (``acc`` dtype) for each expert of the
        block; padding rows of ``t`` must be zero. Experts without rows inside a batched block
        get zero."""
        if not self.batched:
            for g, s, e in self.groups:
                torch.sum(t[s - self.start : e - self.start], 0, dtype=acc, out=out[g])
            return
        B, L = self.num_batched, self.L
        torch.sum(t.view(B, L, t.size(1)), 1, dtype=acc, out=out[self.g0 : self.g0 + B])


def _batched_block(run, device) -> Block:
    g0, g_last = run[0][0], run[-1][0]
    L = max(e - s for _, s, e in run)
    start = run[0][1]
    positions = []
    for g, s, e in run:
        base = (g - g0) * L
        positions.append(torch.arange(base, base + e - s, device=device))
    return Block(start, run[-1][2], list(run), g0=g0, num_batched=g_last - g0 + 1, L=L,
                 row_of_slot=torch.cat(positions))


def plan_blocks(bounds, device) -> list:
    """Cuts the non-empty groups ``bounds = [(g, start, end)]`` (ascending, consecutive slots)
    into blocks, in slot order, choosing each block's form by the rule of this module (or the
    form :func:`set_form` / :func:`use_form` chose)."""
    form = get_form()
    blocks: list = []
    per_group: list = []  # groups waiting for a per-group block
    run: list = []  # groups of a candidate batched block

    def flush_per_group(force: bool):
        nonlocal per_group
        while per_group and (force or per_group[-1][2] - per_group[0][1] >= BLOCK_ROWS):
            # cut at the first group that brings the block to BLOCK_ROWS slots
            cut = next((i + 1 for i, (_, s, e) in enumerate(per_group)
                        if e - per_group[0][1] >= BLOCK_ROWS), len(per_group))
            chunk, per_group = per_group[:cut], per_group[cut:]
            blocks.append(Block(chunk[0][1], chunk[-1][2], chunk))

    def padded_rows(groups) -> int:
        return (groups[-1][0] - groups[0][0] + 1) * max(e - s for _, s, e in groups)

    def flush_run():
        nonlocal run
        if len(run) >= 2 and (form == "batched" or padded_rows(run) >= BATCH_MIN_BLOCK_ROWS):
            flush_per_group(force=True)
            blocks.append(_batched_block(run, device))
        else:
            per_group.extend(run)
            flush_per_group(force=False)
        run = []

    def fits(groups) -> bool:
        padded = padded_rows(groups)
        if form == "batched":
            return padded <= BATCH_MAX_BLOCK_ROWS or groups[-1][0] - groups[0][0] < 2
        real = groups[-1][2] - groups[0][1]
        return padded <= BATCH_MAX_PADDING * real and padded <= BATCH_MAX_BLOCK_ROWS

    for g, s, e in bounds:
        if form == "per_group" or (form == "auto" and e - s > BATCH_MAX_ROWS):
            flush_run()
            per_group.append((g, s, e))
            flush_per_group(force=False)
            continue
        if run and fits(run + [(g, s, e)]):
            run.append((g, s, e))
            continue
        flush_run()
        run = [(g, s, e)]
    flush_run()
    flush_per_group(force=True)
    return blocks
