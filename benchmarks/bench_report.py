"""Writers of a benchmark run: the markdown table, the raw JSON and the PNG plots.

All three read the same list of `Result`s plus `meta` (versions, command, date) and the
providers (those that ran, and those skipped with the reason); none of them measures anything.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional, Sequence

from bench_lib import (ERROR, MODE_TITLES, MODES, NOT_APPLICABLE, NOT_RUN, OK, OOM, WRONG, Case, Provider, Result,
                       format_size, metric, ratio)

META_ORDER = ("date", "gpu", "driver", "cuda", "torch", "nvidia-cutlass-dsl", "flash-attn-4", "flash-attn",
              "flash-attn-3", "triton", "cute_flash", "dtype", "timing", "correctness", "command")


def _row_key(case: Case) -> tuple:
    """Cases that share a row (everything but the provider)."""
    return (case.mode, case.headdim, case.dv, case.causal, case.seqlen_q, case.seqlen_k, case.batch, case.nheads,
            case.nheads_k, case.page_size, case.dtype)


def group_rows(results: Sequence[Result], mode: str) -> list:
    """[(case, {provider: result})] of one mode, in the order the cases first appear."""
    rows: dict = {}
    for r in results:
        if r.case.mode != mode:
            continue
        rows.setdefault(_row_key(r.case), (r.case, {}))[1][r.provider] = r
    return list(rows.values())


def _columns(providers: Sequence[Provider], rows: list) -> list:
    seen = {name for _, cells in rows for name in cells}
    return [p for p in providers if p.skipped is None and p.name in seen]


class _Footnotes:
    """Numbered notes under a table, one per distinct message, naming the providers it concerns."""

    def __init__(self):
        self.notes: dict = {}  # message -> (number, [providers])

    def ref(self, provider: str, message: str) -> str:
        number, names = self.notes.setdefault(message, (len(self.notes) + 1, []))
        if provider not in names:
            names.append(provider)
        return f"[{number}]"

    def lines(self) -> list:
        return [f"{n}. {', '.join(f'`{p}`' for p in names)}: {m}" for m, (n, names) in self.notes.items()]


def _cell(r: Optional[Result], decimals: int, fastest: Optional[Result], notes: _Footnotes) -> str:
    if r is None:
        return ""
    if r.status == OK:
        text = f"{r.value:.{decimals}f}"
        return f"**{text}**" if r is fastest else text
    labels = {WRONG: "wrong", ERROR: "error", OOM: "OOM", NOT_APPLICABLE: "n/a", NOT_RUN: "not run"}
    text = labels.get(r.status, r.status)
    return f"{text} {notes.ref(r.provider, r.message)}" if r.message else text


def _key_cells(case: Case) -> list:
    if case.mode == "decode":
        return [str(case.batch), format_size(case.seqlen_k), case.layout]
    return [case.headdim_label, "yes" if case.causal else "no", format_size(case.seqlen_q),
            f"{case.batch} × {case.nheads}"]


def _key_header(mode: str) -> list:
    if mode == "decode":
        return ["batch", "KV length", "KV cache"]
    return ["head dim", "causal", "seqlen", "batch × heads"]


def render_table(results: Sequence[Result], providers: Sequence[Provider], mode: str) -> str:
    """One mode's table: a row per shape, a column per provider (TFLOP/s or TB/s), then the ratio
    of the best cute_flash backend to the best peer. The fastest correct cell is bold."""
    rows = group_rows(results, mode)
    if not rows:
        return ""
    columns = _columns(providers, rows)
    cute_names = {p.name for p in providers if p.cute_flash}
    unit = metric(rows[0][0])[1]
    decimals = 2 if mode == "decode" else 1
    notes = _Footnotes()
    header = _key_header(mode) + [p.name for p in columns] + ["cute_flash / best peer"]
    lines = [f"### {MODE_TITLES[mode]} ({unit})", "", "| " + " | ".join(header) + " |",
             "|" + "|".join(["---"] * len(_key_header(mode)) + ["---:"] * (len(columns) + 1)) + "|"]
    for case, cells in rows:
        fastest = max((r for r in cells.values() if r.status == OK), key=lambda r: r.value, default=None)
        rel = ratio(cells.values(), cute_names)
        row = _key_cells(case) + [_cell(cells.get(p.name), decimals, fastest, notes) for p in columns]
        row.append(f"{rel:.2f}×" if rel is not None else "–")
        lines.append("| " + " | ".join(row) + " |")
    if notes.notes:
        lines += [""] + notes.lines()
    return "\n".join(lines)


def render_markdown(meta: dict, providers: Sequence[Provider], results: Sequence[Result],
                    plots: Sequence[str] = ()) -> str:
    """The whole report: versions and command, the providers (and why some were skipped), one
    table per mode, the plots."""
    lines = [f"# Attention benchmark: {meta.get('gpu', 'unknown GPU')}", ""]
    for key in META_ORDER:
        if key in meta:
            value = f"`{meta[key]}`" if key == "command" else meta[key]
            lines.append(f"- {key}: {value}")
    lines += ["", "## Providers", ""]
    for p in providers:
        kind = "cute_flash backend" if p.cute_flash else "peer"
        status = f"skipped: {p.skipped}" if p.skipped else "ran"
        lines.append(f"- `{p.name}` ({kind}{': ' + p.description if p.description else ''}): {status}")
    for note in meta.get("notes", ()):
        lines.append(f"- note: {note}")
    lines += ["", "Cells: TFLOP/s (TB/s for decode) of correct results; `wrong` = failed the check against the "
              "oracle, so its time is not reported; bold = fastest in the row. The last column is the best "
              "cute_flash backend over the best peer (– when either has no correct result).", ""]
    for mode in MODES:
        table = render_table(results, providers, mode)
        if table:
            lines += [table, ""]
    for plot in plots:
        lines += [f"![{Path(plot).stem}]({Path(plot).name})", ""]
    return "\n".join(lines)


def write_markdown(path: Path, meta: dict, providers, results, plots=()) -> None:
    Path(path).write_text(render_markdown(meta, providers, results, plots))


def write_json(path: Path, meta: dict, providers: Sequence[Provider], results: Sequence[Result]) -> None:
    doc = {
        "meta": meta,
        "providers": [vars(p) for p in providers],
        "results": [r.to_json() for r in results],
    }
    Path(path).write_text(json.dumps(doc, indent=1) + "\n")


def read_json(path: Path) -> tuple:
    """(meta, providers, results) of a file written by `write_json`."""
    doc = json.loads(Path(path).read_text())
    return doc["meta"], [Provider(**p) for p in doc["providers"]], [Result.from_json(r) for r in doc["results"]]


# ---- plots ----------------------------------------------------------------------------------


def _panel_and_x(case: Case) -> tuple:
    """((panel row, panel column), panel title, x) of a case: forward modes plot against the
    sequence length, a row per causality and a column per head dim; decode against the KV
    length, a row per cache layout (contiguous first) and a column per batch size."""
    if case.mode == "decode":
        return (case.page_size, case.batch), f"{case.layout}, batch {case.batch}", case.seqlen_k
    return ((case.causal, (case.headdim, case.dv)),
            f"head dim {case.headdim_label}, {'causal' if case.causal else 'non-causal'}",
            case.seqlen_q)


def plot_mode(results: Sequence[Result], providers: Sequence[Provider], mode: str, path: Path) -> bool:
    """Throughput (or bandwidth) against sequence length, one panel per head dim and causality
    (decode: per cache layout and batch); cute_flash's lines thick. False when nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in results if r.case.mode == mode and r.status == OK]
    if not ok:
        return False
    panels: dict = {}
    for r in ok:
        key, title, x = _panel_and_x(r.case)
        panels.setdefault(key, (title, {}))[1].setdefault(r.provider, []).append((x, r.value))
    row_keys = sorted({k[0] for k in panels})
    col_keys = sorted({k[1] for k in panels})
    fig, axes = plt.subplots(len(row_keys), len(col_keys), squeeze=False,
                             figsize=(max(9.0, 4.2 * len(col_keys)), 1.0 + 3.4 * len(row_keys)))
    order = [p.name for p in providers]
    cute_names = {p.name for p in providers if p.cute_flash}
    colors = {name: plt.get_cmap("tab10")(i % 10) for i, name in enumerate(order)}
    unit = metric(ok[0].case)[1]
    handles: dict = {}
    for i, rk in enumerate(row_keys):
        for j, ck in enumerate(col_keys):
            ax = axes[i][j]
            if (rk, ck) not in panels:
                ax.set_visible(False)
                continue
            title, lines = panels[(rk, ck)]
            xs = sorted({x for pts in lines.values() for x, _ in pts})
            for name in sorted(lines, key=lambda n: order.index(n) if n in order else len(order)):
                values = dict(lines[name])
                ours = name in cute_names
                # NaN where the provider has no correct result: the line breaks instead of bridging.
                (line,) = ax.plot(xs, [values.get(x, math.nan) for x in xs], marker="o", markersize=4 if ours else 3,
                                  linewidth=3.0 if ours else 1.2, linestyle="-" if ours else "--",
                                  color=colors.get(name), zorder=3 if ours else 2)
                handles.setdefault(f"{name} (cute_flash)" if ours else name, line)
            ax.set_xscale("log", base=2)
            ax.set_xticks(xs)
            ax.set_xticklabels([format_size(x) for x in xs])
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("KV length" if mode == "decode" else "sequence length")
            ax.set_ylabel(unit)
            ax.set_ylim(bottom=0)
            ax.grid(True, alpha=0.3)
    ncol = min(len(handles), 5)
    legend_rows = -(-len(handles) // ncol)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=ncol, frameon=False)
    fig.suptitle(f"{MODE_TITLES[mode]}: {unit}")
    fig.tight_layout(rect=(0, 0.35 * legend_rows / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_plots(results: Sequence[Result], providers: Sequence[Provider], prefix: Path) -> list:
    """`<prefix>-<mode>.png` for every mode with a correct result; returns the paths written."""
    written = []
    for mode in MODES:
        path = Path(f"{prefix}-{mode}.png")
        if plot_mode(results, providers, mode, path):
            written.append(path)
    return written
