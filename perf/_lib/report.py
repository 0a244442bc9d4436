"""Markdown table and PNG plots from a sweep directory's ``records.jsonl``. Reads JSONL only; never re-runs anything.

Writes into the sweep directory: ``report.md``, ``throughput.png`` (output tokens/s vs concurrency), ``speedup.png``
(dflash / baseline tokens/s at equal dataset, block size and concurrency), ``tau_hist.png`` (acceptance-length
histogram of the dflash points per dataset, from the server's counters) and ``latency.png`` (TTFT and ITL).
"""

from __future__ import annotations

import argparse
import math
import os
from collections import defaultdict
from pathlib import Path

from .record import PerfRecord, load_records

PLOTS = ("throughput.png", "speedup.png", "tau_hist.png", "latency.png")
COLUMNS = ["model", "dataset", "B", "C", "requests", "tokens", "tok/s", "req/s", "TTFT p50 ms", "TTFT p99 ms",
           "ITL p50 ms", "ITL p99 ms", "τ", "speed-up"]


def save_png(fig, path: str | Path) -> Path:
    """Lay out ``fig``, write it to ``path`` atomically (a reader never sees half a PNG) and close it."""
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return path


def _f(x: float, digits: int = 2) -> str:
    return "n/a" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def speedups(records: list[PerfRecord]) -> dict[tuple[str, int, int], float]:
    """(dataset, block size, concurrency) -> dflash tokens/s / baseline tokens/s (the last record of each wins)."""
    tps = {(r.model, r.dataset, r.block_size, r.concurrency): r.output_tokens_per_s for r in records}
    return {(d, b, c): v / tps[("baseline", d, b, c)]
            for (m, d, b, c), v in tps.items() if m == "dflash" and tps.get(("baseline", d, b, c))}


def table_rows(records: list[PerfRecord]) -> list[list[str]]:
    sp = speedups(records)
    rows = []
    for r in records:
        s = sp.get((r.dataset, r.block_size, r.concurrency)) if r.model == "dflash" else None
        rows.append([r.model, r.dataset, str(r.block_size), str(r.concurrency), str(r.requests), str(r.output_tokens),
                     _f(r.output_tokens_per_s), _f(r.requests_per_s, 3), _f(r.ttft_ms_p50, 0), _f(r.ttft_ms_p99, 0),
                     _f(r.itl_ms_p50, 1), _f(r.itl_ms_p99, 1), _f(r.tau_mean), _f(s) if s else ""])
    return rows


def markdown(records: list[PerfRecord], title: str) -> str:
    envs = {(r.env.get("git_commit"), r.env.get("perf_analyzer"), r.env.get("triton_server")) for r in records}
    first = records[0].env if records else {}
    m = first.get("machine", {})
    lines = [f"# {title}", ""]
    lines += [f"- machine: {m.get('cpu', '?')} ({m.get('cpus', '?')} CPUs), GPU: {m.get('gpu', '?')}, "
              f"{m.get('platform', '?')}" + (f"; {first['label']}" if first.get("label") else "")]
    drafters = sorted({(r.drafter_dir, r.drafter_trained) for r in records}, key=str)
    for d, trained in drafters:
        state = {True: "trained", False: "UNTRAINED (random)", None: "training state unknown"}[trained]
        lines.append(f"- drafter: `{d or '?'}` ({state})")
    for commit, pa, triton in sorted(envs, key=str):
        lines.append(f"- git {commit}, perf_analyzer `{pa}`, Triton server {triton}, "
                     f"tritonclient {first.get('tritonclient')}, torch {first.get('torch')}")
    lines += ["- tokens counted from the streamed `output_ids`; τ = (accepted + steps) / steps from the server's "
              "DFlash counters over each point; ITL = response gap / tokens in the later response", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(records)]
    lines += ["", *[f"![{p}]({p})" for p in PLOTS], ""]
    return "\n".join(lines)


def _series(records, key):
    """{(model, dataset, block size): sorted [(concurrency, key(record))]} (the last record of a point wins)."""
    pts = defaultdict(dict)
    for r in records:
        pts[(r.model, r.dataset, r.block_size)][r.concurrency] = key(r)
    return {k: sorted(v.items()) for k, v in sorted(pts.items())}


def draw_tau_hist(ax, hist: dict[str, dict[int, int]], title: str) -> None:
    """Grouped bars, one series per label: the fraction of verify steps that accepted τ tokens."""
    width = 0.8 / max(1, len(hist))
    for i, (name, h) in enumerate(sorted(hist.items())):
        total = sum(h.values()) or 1
        taus = sorted(h)
        mean = sum(t * n for t, n in h.items()) / total
        ax.bar([t + (i - (len(hist) - 1) / 2) * width for t in taus], [h[t] / total for t in taus], width,
               label=f"{name} (mean τ {mean:.2f}, {total} steps)")
    ax.set(xlabel="acceptance length τ", ylabel="fraction of verify steps", title=title)
    if hist:
        ax.legend(fontsize=8)


def plot(records: list[PerfRecord], out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(m, d, b):
        return f"{m} {d}" + (f" B={b}" if m == "dflash" else "")

    concs = sorted({r.concurrency for r in records})

    def xaxis(ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(concs, [str(c) for c in concs])
        ax.minorticks_off()
        ax.set_xlabel("concurrency")

    paths = []
    fig, ax = plt.subplots(figsize=(6, 4))
    for (m, d, b), pts in _series(records, lambda r: r.output_tokens_per_s).items():
        ax.plot([c for c, _ in pts], [v for _, v in pts], "o-" if m == "dflash" else "s--", label=label(m, d, b))
    ax.set(ylabel="output tokens/s", title="Throughput")
    xaxis(ax)
    ax.legend(fontsize=8)
    paths.append(save_png(fig, out / "throughput.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    sp = defaultdict(list)
    for (d, b, c), v in sorted(speedups(records).items()):
        sp[(d, b)].append((c, v))
    for (d, b), pts in sp.items():
        ax.plot([c for c, _ in pts], [v for _, v in pts], "o-", label=f"{d} B={b}")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set(ylabel="dflash / baseline tokens/s", title="Speed-up")
    xaxis(ax)
    if sp:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "no dflash/baseline pairs", ha="center", transform=ax.transAxes)
    paths.append(save_png(fig, out / "speedup.png"))

    hist = defaultdict(lambda: defaultdict(int))
    for r in records:
        if r.model == "dflash":
            for t, n in r.tau_hist.items():
                hist[f"{r.dataset} B={r.block_size}"][int(t)] += n
    fig, ax = plt.subplots(figsize=(6, 4))
    draw_tau_hist(ax, hist, "τ histogram (dflash)")
    paths.append(save_png(fig, out / "tau_hist.png"))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    panels = [("TTFT ms", "ttft_ms_p50", "ttft_ms_p99"), ("ITL ms", "itl_ms_p50", "itl_ms_p99")]
    for ax, (name, p50, p99) in zip(axes, panels):
        for (m, d, b), pts in _series(records, lambda r: (getattr(r, p50), getattr(r, p99))).items():
            (line,) = ax.plot([c for c, _ in pts], [v[0] for _, v in pts], "o-", label=f"{label(m, d, b)} p50")
            ax.plot([c for c, _ in pts], [v[1] for _, v in pts], ":", color=line.get_color(), label="p99")
        ax.set(ylabel=name, title=name.split()[0])
        xaxis(ax)
        ax.legend(fontsize=7)
    paths.append(save_png(fig, out / "latency.png"))
    return paths


def write_report(sweep_dir: str | Path, title: str = "") -> Path:
    sweep_dir = Path(sweep_dir)
    records = load_records(sweep_dir / "records.jsonl")
    if not records:
        raise ValueError(f"{sweep_dir / 'records.jsonl'} has no records")
    plot(records, sweep_dir)
    md = sweep_dir / "report.md"
    md.write_text(markdown(records, title or f"DFlash serving sweep: {sweep_dir.name}"))
    return md


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="perf/report.py", description=__doc__.split("\n\n")[0])
    p.add_argument("sweep_dir", help="a directory with records.jsonl (written by perf/sweep.py)")
    p.add_argument("--title", default="")
    a = p.parse_args(argv)
    print(write_report(a.sweep_dir, a.title))
    return 0
