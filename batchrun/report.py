"""`batchrun report OUTPUT`: the run's time series (`_metrics.json` "series") drawn to a PNG.

Three panels over time: throughput (generated tokens/s and rows/s between points), concurrency (running,
waiting, swapped sequences) and the KV cache (blocks in use of the total, preemptions so far). A folder of
job-array shards gets one line per shard. matplotlib is an optional extra (`pip install 'batchrun[plot]'`),
imported only here; the figure is drawn on an Agg canvas, touching no global backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batchrun.config import JobError
from batchrun.output.folder import METRICS, SHARD_RE

DEFAULT_SIZE = (1200, 900)  # pixels
DPI = 100


def load_series(output: Path) -> list[tuple[str, dict[str, Any]]]:
    """(label, series) of the run in OUTPUT, or of each shard in it."""
    if not output.is_dir():
        raise JobError(f"{output} is not an output folder")
    files = [("run", output / METRICS)] if (output / METRICS).is_file() else sorted(
        ((p.name, p / METRICS) for p in output.iterdir()
         if p.is_dir() and SHARD_RE.match(p.name) and (p / METRICS).is_file()),
        key=lambda item: tuple(int(x) for x in SHARD_RE.match(item[0]).groups()[::-1]))
    if not files:
        raise JobError(f"{output} has no {METRICS} (is it a batchrun output folder?)")
    found = []
    for label, path in files:
        try:
            series = json.loads(path.read_text()).get("series")
        except (OSError, ValueError) as e:
            raise JobError(f"cannot read {path}: {e}") from None
        if series and series.get("t_s"):
            found.append((label, series))
    if not found:
        raise JobError(f"{output}: {METRICS} has no time series (written by batchrun 0.1 or later runs)")
    return found


def _rates(t: list[float], counts: list[int]) -> tuple[list[float], list[float]]:
    """Per-second rate between consecutive points, placed at the interval's midpoint."""
    mids, rates = [], []
    for (t0, c0), (t1, c1) in zip(zip(t, counts), zip(t[1:], counts[1:])):
        if t1 > t0:
            mids.append((t0 + t1) / 2)
            rates.append((c1 - c0) / (t1 - t0))
    return mids, rates


def draw(output: str | Path, dest: str | Path | None = None, size: tuple[int, int] = DEFAULT_SIZE) -> Path:
    """Write the report PNG (default OUTPUT/report.png) of `size` pixels; returns its path."""
    output = Path(output)
    runs = load_series(output)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise JobError("drawing a report needs matplotlib: pip install 'batchrun[plot]'") from None
    width, height = size
    if width < 200 or height < 200:
        raise JobError(f"the picture must be at least 200x200 pixels, got {width}x{height}")
    fig = Figure(figsize=(width / DPI, height / DPI), dpi=DPI)
    FigureCanvasAgg(fig)
    speed, busy, kv = fig.subplots(3, 1, sharex=True)
    many = len(runs) > 1
    for label, s in runs:
        t = s["t_s"]
        tag = f"{label}: " if many else ""
        speed.plot(*_rates(t, s["generated_tokens"]), label=f"{tag}generated tokens/s")
        rows_axis = speed if many else _twin(speed)
        rows_axis.plot(*_rates(t, s["rows_done"]), linestyle="--", label=f"{tag}rows/s",
                       color=None if many else "tab:orange")
        if not many:
            rows_axis.legend(loc="upper left", fontsize="small")
        for name in ("running", "waiting", "swapped"):
            busy.plot(t, s[name], label=f"{tag}{name}")
        kv.plot(t, s["kv_blocks_in_use"], label=f"{tag}KV blocks in use")
        if s.get("kv_blocks_total"):
            kv.axhline(s["kv_blocks_total"], linestyle=":", color="gray", label=f"{tag}KV blocks total")
        if any(s["preemptions"]):
            kv.plot(t, s["preemptions"], linestyle="--", label=f"{tag}preemptions so far")
    speed.set_title(f"batchrun run: {output.name}")
    speed.set_ylabel("tokens / s")
    busy.set_ylabel("sequences")
    kv.set_ylabel("KV blocks")
    kv.set_xlabel("seconds since the run started")
    for ax in (speed, busy, kv):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    dest = Path(dest) if dest is not None else output / "report.png"
    try:
        fig.savefig(dest, dpi=DPI, format="png")
    except OSError as e:
        raise JobError(f"cannot write {dest}: {e.strerror or e}") from None
    return dest


def _twin(ax):
    twin = ax.twinx()
    twin.set_ylabel("rows / s")
    return twin
