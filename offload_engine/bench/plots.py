"""The benchmark figures, drawn with matplotlib's Agg canvas (no display, no pyplot).

Every figure carries the machine and the date in a footer.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.layout_engine import ConstrainedLayoutEngine
from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

from offload_engine.bench import LatencySeries, SweepPoint, series_label

DIRECTION_TITLES = {"store": "store (KV cache -> tier)", "load": "load (tier -> KV cache)"}


def _footer(fig: Figure, machine: str, day: str, note: str) -> None:
    text = f"machine: {machine} | date: {day}" + (f" | {note}" if note else "")
    fig.text(0.01, 0.01, text, fontsize=7, color="0.35", ha="left", va="bottom")


def _figure(height: float = 4.4) -> Figure:
    # constrained layout, leaving a strip at the bottom for the footer
    return Figure(figsize=(10, height), layout=ConstrainedLayoutEngine(rect=(0, 0.04, 1, 0.96)))


def plain_ms_ticks(lo: float, hi: float) -> list[float]:
    """Tick values for a log axis from ``lo`` to ``hi`` ms: 1-2-5 steps (1, 2, 5, 10, 20, ...)
    over up to three decades, powers of ten beyond that, so the labels never crowd."""
    if not (0 < lo <= hi):
        return []
    first, last = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    steps = (1, 2, 5) if last - first <= 3 else (1,)
    ticks = [m * 10.0**e for e in range(first, last + 1) for m in steps]
    # the data, framed by the nearest tick at or beyond each end: labelled values at both ends
    below = [t for t in ticks if t <= lo][-1:]
    inside = [t for t in ticks if lo < t < hi]
    above = [t for t in ticks if t >= hi][:1]
    return below + inside + above


def _plain_ms_axis(ax: Axes, values: Sequence[float]) -> None:
    """A log x axis in milliseconds labelled as plain numbers ("2", "5", "10", "0.05")."""
    ax.set_xscale("log")
    ticks = plain_ms_ticks(min(values, default=0.0), max(values, default=0.0))
    if not ticks:
        return
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_locator(LogLocator(base=10, subs=tuple(range(1, 10))))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(ticks[0], ticks[-1])


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=120)
    return path


def throughput_figure(
    points: Sequence[SweepPoint], machine: str, day: str, path: Path, note: str = ""
) -> Path:
    """Draw :func:`draw_throughput` into ``path`` (PNG)."""
    return _save(draw_throughput(points, machine, day, note), path)


def latency_figure(
    series: Sequence[LatencySeries], machine: str, day: str, path: Path, note: str = ""
) -> Path:
    """Draw :func:`draw_latency` into ``path`` (PNG)."""
    return _save(draw_latency(series, machine, day, note), path)


def draw_throughput(points: Sequence[SweepPoint], machine: str, day: str, note: str = "") -> Figure:
    """GB/s against blocks per job, one panel per direction, one line per strategy.

    Points are the median repeat; bars span the slowest to the fastest repeat.
    """
    fig = _figure()
    axes = fig.subplots(1, 2, sharey=True)
    block_kib = {p.block_bytes // 1024 for p in points}
    sizes = sorted({p.blocks_per_job for p in points})
    for ax, direction in zip(axes, ("store", "load"), strict=True):
        series: dict[str, list[SweepPoint]] = {}
        for p in points:
            if p.direction == direction:
                series.setdefault(series_label(p.medium, p.strategy, p.variant), []).append(p)
        for label, pts in series.items():
            pts.sort(key=lambda p: p.blocks_per_job)
            ys = [p.gbps for p in pts]
            spread = [
                [y - p.gbps_min for y, p in zip(ys, pts, strict=True)],
                [p.gbps_max - y for y, p in zip(ys, pts, strict=True)],
            ]
            ax.errorbar(
                [p.blocks_per_job for p in pts], ys, yerr=spread, fmt="o-", capsize=3, label=label
            )
        ax.set_xscale("log", base=2)
        if sizes:
            ax.set_xticks(sizes, labels=[str(n) for n in sizes])
            ax.minorticks_off()
        ax.set_title(DIRECTION_TITLES[direction])
        kib = "/".join(str(k) for k in sorted(block_kib))
        ax.set_xlabel(f"blocks per job ({kib} KiB each)")
        ax.grid(True, which="both", alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    repeats = max((len(p.wall_s) for p in points), default=1)
    axes[0].set_ylabel(
        "GB/s (bytes moved / wall time)"
        + (f"\nmedian of {repeats} repeats, bars: min to max" if repeats > 1 else "")
    )
    axes[0].set_ylim(bottom=0)
    fig.suptitle("KV-block transfer throughput")
    _footer(fig, machine, day, note)
    return fig


def draw_latency(series: Sequence[LatencySeries], machine: str, day: str, note: str = "") -> Figure:
    """Distribution (ECDF) of submit->result latency, one panel per direction."""
    fig = _figure(height=4.4 + 0.15 * len({(x.medium, x.strategy, x.depth) for x in series}))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, direction in zip(axes, ("store", "load"), strict=True):
        shown = [s for s in series if s.direction == direction and s.latencies_ms]
        for s in shown:
            xs = sorted(s.latencies_ms)
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            label = (
                f"{series_label(s.medium, s.strategy, s.variant)}, {s.blocks_per_job} blocks, "
                f"{s.depth} in flight: p50 {s.p50_ms:.2f} / p99 {s.p99_ms:.2f} ms"
            )
            ax.step(xs, ys, where="post", label=label)
        _plain_ms_axis(ax, [v for s in shown for v in s.latencies_ms if v > 0])
        ax.set_title(DIRECTION_TITLES[direction])
        ax.set_xlabel("submit -> result latency (ms)")
        ax.axhline(0.5, color="0.6", lw=0.6, ls=":")
        ax.axhline(0.99, color="0.6", lw=0.6, ls=":")
        ax.grid(True, which="both", alpha=0.3)
        if shown:
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16))
    axes[0].set_ylabel("fraction of jobs")
    axes[0].set_ylim(0, 1.02)
    fig.suptitle("Job latency distribution")
    _footer(fig, machine, day, note)
    return fig


def ttft_figure(
    rows: Sequence[dict[str, Any]], machine: str, day: str, path: Path, note: str = ""
) -> Path:
    """Draw :func:`draw_ttft` into ``path`` (PNG)."""
    return _save(draw_ttft(rows, machine, day, note), path)


def draw_ttft(rows: Sequence[dict[str, Any]], machine: str, day: str, note: str = "") -> Figure:
    """Time to first token per (hit, new tokens), as a multiple of max(load, compute):
    load-then-compute and each layer-wise part size, with the floors (where the rows
    have them), the target (1.10) and the bound (1.0) drawn in. ``rows``: the ttft
    pass's rows."""
    fig = _figure(4.8)
    ax = fig.add_subplot()
    groups = sorted({g for r in rows for g in r["layerwise_ms"]}, key=int)
    series = [("load, then compute (a)", "load_then_compute_ms", None)] + [
        (f"layer-wise, {g} layer{'s' if g != '1' else ''} a job (b)", "layerwise_ms", g)
        for g in groups
    ]
    width = 0.8 / len(series)
    for i, (label, key, g) in enumerate(series):
        values = []
        for r in rows:
            bound = max(r["load_ms"], r["compute_ms"])
            ms = r[key] if g is None else r[key][g]
            values.append(ms / bound)
        xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, values, width=width, label=label)
    marks = (
        ("floor_vs_bound", "black", "floor: one contiguous copy per part, no engine (best G)"),
        ("staged_floor_vs_bound", "0.55", "staged floor: those copies, each then scattered"),
    )
    for key, color, label in marks:
        floors = [(j, r[key]) for j, r in enumerate(rows) if key in r]
        if floors:
            ax.scatter(
                [j for j, _ in floors],
                [f for _, f in floors],
                marker="_",
                s=900,
                linewidths=2,
                color=color,
                zorder=3,
                label=label,
            )
    ax.axhline(1.0, color="0.2", linewidth=1, label="max(load, compute)")
    ax.axhline(1.10, color="tab:red", linewidth=1, linestyle="--", label="target: 1.10 x max")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([f"H {r['hit_tokens']}\nN {r['new_tokens']}" for r in rows], fontsize=8)
    ax.set_ylabel("time to first token / max(load, compute)")
    ax.set_ylim(0.8, max(2.1, ax.get_ylim()[1]))
    ax.set_title("Prefix hit of H tokens in the pinned tier, N new tokens (Llama-3-8B shapes)")
    ax.legend(fontsize=8, loc="upper right")
    _footer(fig, machine, day, note)
    return fig


#: the step's target over the floor, in points of slowdown: STEP_TARGET_POINTS, and
#: STEP_SATURATED_POINTS from STEP_SATURATED_BLOCKS blocks each way per step (64 MiB each
#: way, which keeps a host link of about 50 GB/s each way busy for 1.3 ms: a short
#: step cannot hide it)
STEP_TARGET_POINTS, STEP_SATURATED_POINTS, STEP_SATURATED_BLOCKS = 1.5, 3.0, 32


def step_figure(
    rows: Sequence[Mapping[str, Any]], machine: str, day: str, path: Path, note: str = ""
) -> Path:
    """Draw :func:`draw_step` into ``path`` (PNG)."""
    return _save(draw_step(rows, machine, day, note), path)


def _step_cells(
    rows: Sequence[Mapping[str, Any]],
) -> dict[tuple[str, str, str], dict[str, dict[int, list[float]]]]:
    """(layout, mode, stream) -> variant -> blocks -> slowdowns in % (one per round)."""
    cells: dict[tuple[str, str, str], dict[str, dict[int, list[float]]]] = {}
    for r in rows:
        key = (str(r.get("layout", "per-layer")), str(r["mode"]), str(r["stream"]))
        by_n = cells.setdefault(key, {}).setdefault(str(r["variant"]), {})
        by_n.setdefault(int(r["blocks"]), []).append(100 * float(r["slowdown"]))
    return cells


def _median_and_spread(values: dict[int, list[float]]) -> tuple[list[int], list[float], Any]:
    ns = sorted(values)
    ys = [statistics.median(values[n]) for n in ns]
    spread = [
        [y - min(values[n]) for y, n in zip(ys, ns, strict=True)],
        [max(values[n]) - y for y, n in zip(ys, ns, strict=True)],
    ]
    return ns, ys, spread


def _draw_step_cell(
    ax: Axes, cell: dict[str, dict[int, list[float]]], colors: dict[str, str], floor: str
) -> None:
    """One panel: the floor and its target band, then a line per variant in ``colors``."""
    if floor in cell:
        ns, ys, spread = _median_and_spread(cell[floor])
        top = [
            y + (STEP_SATURATED_POINTS if n >= STEP_SATURATED_BLOCKS else STEP_TARGET_POINTS)
            for n, y in zip(ns, ys, strict=True)
        ]
        band = (
            f"target: floor + {STEP_TARGET_POINTS:g} points "
            f"(+{STEP_SATURATED_POINTS:g} from {STEP_SATURATED_BLOCKS} blocks)"
        )
        ax.fill_between(ns, ys, top, color="0.85", label=band)
        ax.errorbar(ns, ys, yerr=spread, fmt="s-", color="0.1", lw=1.6, capsize=3,
                    label="floor: one contiguous copy each way")  # fmt: skip
    for v, color in colors.items():
        if v in cell:
            ns, ys, spread = _median_and_spread(cell[v])
            ax.errorbar(ns, ys, yerr=spread, fmt="o-", color=color, capsize=3, label=v)
    ax.axhline(0, color="0.5", lw=0.6)
    ax.grid(True, alpha=0.3)


def draw_step(rows: Sequence[Mapping[str, Any]], machine: str, day: str, note: str = "") -> Figure:
    """A decode step's slowdown (%) against blocks stored and loaded each step, one
    panel per (layout, mode, stream), one line per engine variant, with the floor (the
    same bytes as one contiguous copy each way) and the target band above it drawn in.

    ``rows``: the step pass's rows (:class:`~offload_engine.bench.step.StepRow` as
    dicts), from one run or several: points are the median over the rows of a cell,
    bars span the lowest to the highest."""
    from offload_engine.bench.step import BASELINE, FLOOR, LAYOUTS

    cells = _step_cells(rows)
    found = {k[0] for k in cells}
    layouts = [x for x in LAYOUTS if x in found] + sorted(found - set(LAYOUTS))
    modes = list(dict.fromkeys((k[1], k[2]) for k in cells))
    variants = dict.fromkeys(v for c in cells.values() for v in c if v not in (BASELINE, FLOOR))
    colors = {v: f"C{i % 10}" for i, v in enumerate(variants)}
    runs = max((len(x) for c in cells.values() for n in c.values() for x in n.values()), default=1)
    height = 1.6 + 2.8 * max(1, len(layouts))
    fig = _figure(height)
    grid = fig.subplots(
        max(1, len(layouts)), max(1, len(modes)), sharex=True, sharey=True, squeeze=False
    )
    sizes = sorted({int(r["blocks"]) for r in rows})
    for (i, layout), (j, (mode, stream)) in [
        (a, b) for a in enumerate(layouts) for b in enumerate(modes)
    ]:
        ax = grid[i][j]
        _draw_step_cell(ax, cells.get((layout, mode, stream), {}), colors, FLOOR)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, labels=[str(n) for n in sizes])
        ax.minorticks_off()
        ax.set_title(f"{layout}, {mode}, {stream} stream", fontsize=9)
        if i == len(layouts) - 1:
            ax.set_xlabel("blocks each way per step (2 MiB each)", fontsize=8)
        if j == 0:
            spread = f"\nmedian of {runs} runs, bars: min to max" if runs > 1 else ""
            ax.set_ylabel(f"step slowdown (%){spread}", fontsize=8)
    handles: list[Any] = []
    labels: list[str] = []
    for ax in grid.flat:  # a panel may lack a variant that another has
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            if label not in labels:
                handles.append(h)
                labels.append(label)
    # the legend below the panels, above the footer, in a strip the layout leaves free
    # (an "outside" legend would sit on the footer)
    strip = (0.3 + 0.22 * math.ceil(len(labels) / 4)) / height
    engine = fig.get_layout_engine()
    if isinstance(engine, ConstrainedLayoutEngine):
        engine.set(rect=(0, strip, 1, 1 - strip))
    if handles:
        fig.legend(handles, labels, loc="lower center", bbox_to_anchor=(0.5, 0.2 / height),
                   ncols=min(4, len(labels)), fontsize=8)  # fmt: skip
    fig.suptitle("Decode step slowdown while the engine stores and loads N blocks each step")
    _footer(fig, machine, day, note)
    return fig
