"""Small timing and reporting helpers shared by the benchmarks.

The machines these benchmarks run on are shared and noisy, so every comparison
runs all implementations in one process, interleaved round-robin, and reports
medians and ratios rather than absolute numbers from separate runs.
"""

from __future__ import annotations

import csv
import gc
import math
import os
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "Entry",
    "SavedBytes",
    "environment_header",
    "format_table",
    "interleaved",
    "line_plot",
    "time_once",
    "write_csv",
]


# --------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------


def _preloaded_allocators() -> list[str]:
    """Names of alternative allocators mapped into this process.

    LD_PRELOAD may name a wrapper script or a path without the library's
    usual name, so also look at what the dynamic loader actually mapped.
    """
    found = set()
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        maps = ""
    sources = (maps, os.environ.get("LD_PRELOAD", ""))
    for name in ("jemalloc", "tcmalloc", "mimalloc"):
        if any(name in s for s in sources):
            found.add(name)
    return sorted(found)


def environment_header() -> list[str]:
    """Lines describing what the numbers depend on: torch build, CPU, allocator."""
    malloc_vars = {k: v for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")}
    allocators = _preloaded_allocators()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return [
        f"load average (1 min) at start: {load:.2f} on {os.cpu_count()} CPUs; another busy "
        "process distorts every number below",
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs",
        f"allocator: {', '.join(allocators) if allocators else 'glibc malloc (nothing preloaded)'}; "
        f"LD_PRELOAD={os.environ.get('LD_PRELOAD', '') or '(unset)'}; "
        f"MALLOC_* = {malloc_vars if malloc_vars else '(none set)'}",
    ]


# --------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------


def time_once(fn: Callable[[], object]) -> float:
    """Wall time of one call in seconds (CPU only, so no synchronisation)."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


@dataclass
class Entry:
    """One implementation taking part in an interleaved comparison.

    ``fn`` is timed. ``reset`` runs untimed after every call; it is where
    gradients are set to None, so that freeing them is not charged to the
    next implementation in the round.
    ``reps``/``warmup`` override the comparison-wide counts, so a very slow
    implementation can take fewer samples without holding the fast ones back.
    """

    name: str
    fn: Callable[[], object]
    reset: Callable[[], None] | None = None
    reps: int | None = None
    warmup: int | None = None
    times: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.times) if self.times else float("nan")


def _call(entry: Entry) -> float:
    t = time_once(entry.fn)
    if entry.reset is not None:
        entry.reset()
    return t


def interleaved(entries: Sequence[Entry], reps: int, warmup: int) -> None:
    """Fill ``entry.times`` by running the entries round-robin.

    Each repetition visits every entry once, starting from a rotating offset,
    so slow drift of the machine (thermal, neighbours) and any first-in-round
    effect are spread evenly over the implementations.
    """
    gc.collect()
    max_warmup = max((e.warmup if e.warmup is not None else warmup) for e in entries)
    for i in range(max_warmup):
        for e in entries:
            if i < (e.warmup if e.warmup is not None else warmup):
                _call(e)
    max_reps = max((e.reps if e.reps is not None else reps) for e in entries)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for i in range(max_reps):
            n = len(entries)
            for j in range(n):
                e = entries[(i + j) % n]
                if i < (e.reps if e.reps is not None else reps):
                    e.times.append(_call(e))
    finally:
        if gc_was_enabled:
            gc.enable()


# --------------------------------------------------------------------------
# Bytes saved for backward
# --------------------------------------------------------------------------


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


class SavedBytes:
    """Counts the distinct storages autograd saves for backward.

    Use as a context manager around a forward pass. Each storage is counted
    once, keyed by (data_ptr, nbytes) of its untyped storage, so several views
    of one buffer count once. Storages of ``inputs`` (weights, x, ...) are
    reported separately: they are alive anyway, so they cost nothing extra.

    Tensors a custom autograd.Function stashes on ``ctx`` as attributes instead
    of ``save_for_backward`` bypass these hooks and are not counted.
    """

    def __init__(self, inputs: Iterable[torch.Tensor]):
        self._input_keys = {_storage_key(t) for t in inputs}
        # key -> (nbytes, is_floating)
        self._seen: dict[tuple[int, int], tuple[int, bool]] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        self._seen.setdefault(key, (key[1], t.is_floating_point()))
        return t

    @staticmethod
    def _unpack(t: torch.Tensor) -> torch.Tensor:
        return t

    def __enter__(self) -> SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    def totals(self, float_scale: float = 1.0) -> tuple[float, float]:
        """(all saved bytes, saved bytes excluding input storages).

        ``float_scale`` rescales floating-point storages, to convert a
        measurement taken in one dtype to another dtype's element size.
        """
        total = activations = 0.0
        for key, (nbytes, is_float) in self._seen.items():
            b = nbytes * (float_scale if is_float else 1.0)
            total += b
            if key not in self._input_keys:
                activations += b
        return total, activations


# --------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------


def format_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
    """Plain-text table with right-aligned columns."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.rjust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)


def write_csv(path: str | os.PathLike, rows: Sequence[dict]) -> None:
    """Write ``rows`` (dicts, possibly with different keys) as one CSV file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    columns: list[str] = []
    for r in rows:
        columns += [k for k in r if k not in columns]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)


_COLORS = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
           "#7f7f7f", "#bcbd22"]


def line_plot(out: str | os.PathLike, series: Sequence[tuple[str, Sequence[tuple[float, float]]]],
              xlabel: str, ylabel: str, hline: float | None = None) -> Path:
    """Lines of ``(label, [(x, y)])`` over a log2 x axis: a PNG with matplotlib, else (the
    optional ``plots`` extra not installed) an SVG of the same plot written by hand. ``hline``
    draws a reference line (a ratio of 1, a ceiling). Returns the file written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        svg = out.with_suffix(".svg")
        svg.write_text(_svg_line_plot(series, xlabel, ylabel, hline))
        print(f"matplotlib is not installed (pip install -e .[plots]): wrote {svg} instead")
        return svg
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, pts in series:
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "-o", ms=3, label=label)
    if hline is not None:
        ax.axhline(hline, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_ylim(bottom=0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=6)
    fig.savefig(out, dpi=150, bbox_inches="tight")
    plt.close(fig)
    print(f"wrote {out}")
    return out


def _svg_line_plot(series, xlabel: str, ylabel: str, hline: float | None) -> str:
    W, H, left, right, top, bottom = 640, 420, 60, 230, 20, 50
    xs = sorted({p[0] for _, pts in series for p in pts}) or [1.0]
    ymax = max([hline or 0.0] + [p[1] for _, pts in series for p in pts] + [1e-9]) * 1.05
    lo = math.log2(xs[0])
    hi = math.log2(xs[-1]) if xs[-1] > xs[0] else lo + 1

    def px(x):
        return left + (math.log2(x) - lo) / (hi - lo) * (W - left - right)

    def py(y):
        return H - bottom - y / ymax * (H - top - bottom)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" '
             'font-family="sans-serif" font-size="11">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<line x1="{left}" y1="{py(0)}" x2="{W - right}" y2="{py(0)}" stroke="black"/>',
             f'<line x1="{left}" y1="{py(0)}" x2="{left}" y2="{top}" stroke="black"/>']
    if hline is not None:
        parts.append(f'<line x1="{left}" y1="{py(hline)}" x2="{W - right}" y2="{py(hline)}" '
                     'stroke="gray" stroke-dasharray="4"/>')
    for x in xs:
        parts.append(f'<text x="{px(x)}" y="{H - bottom + 15}" text-anchor="middle">{x:g}</text>')
    for i in range(6):
        y = ymax * i / 5
        parts.append(f'<text x="{left - 5}" y="{py(y) + 4}" text-anchor="end">{y:.2f}</text>')
    parts.append(f'<text x="{(left + W - right) / 2}" y="{H - 12}" text-anchor="middle">'
                 f'{xlabel}</text>')
    parts.append(f'<text x="14" y="{(top + H - bottom) / 2}" text-anchor="middle" '
                 f'transform="rotate(-90 14 {(top + H - bottom) / 2})">{ylabel}</text>')
    for i, (label, pts) in enumerate(series):
        c = _COLORS[i % len(_COLORS)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="1.5"/>')
        parts += [f'<circle cx="{px(x):.1f}" cy="{py(y):.1f}" r="2.5" fill="{c}"/>' for x, y in pts]
        ly = top + 14 * i + 10
        parts.append(f'<line x1="{W - right + 10}" y1="{ly}" x2="{W - right + 30}" y2="{ly}" '
                     f'stroke="{c}" stroke-width="1.5"/>')
        parts.append(f'<text x="{W - right + 35}" y="{ly + 4}">{label}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def destroy_process_group() -> None:
    """``dist.destroy_process_group()`` after freeing the autograd graphs' reference cycles.

    The cycles hold tensors of the functional collectives; freed at exit instead, from gloo's
    worker threads, they abort the process now and then ("terminate called without an active
    exception", seen in about one EP run in four on torch 2.13). The barrier keeps a rank from
    tearing the group down while another still exchanges.
    """
    import torch.distributed as dist

    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
