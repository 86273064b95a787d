"""The suite's Markdown report (for docs/performance.md): the machine and the settings, the
table of figures with their spread over rounds, and notes.
"""

from __future__ import annotations


def _num(x: float) -> str:
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.3g}"


def _cell(figure: object) -> str:
    if figure is None:
        return "—"
    if isinstance(figure, str):
        return figure
    if "error" in figure:
        return f"failed ({figure['error'][:60]})"
    text = _num(figure["median"])
    if len(figure["values"]) > 1:
        text += f" ({_num(figure['min'])}–{_num(figure['max'])})"
    return text


def markdown(report: dict) -> str:
    """Two lines on the machine and the settings, the table, and notes."""
    m, s = report["machine"], report["settings"]
    dp = bool(s["deepmd_env"])
    versions = f"mdtrain {m['mdtrain']} ({m['mdtrain_commit']}"
    versions += ", modified)" if m["mdtrain_modified"] else ")"
    if dp:
        versions += f", DeePMD-kit {m.get('deepmd_kit')} (torch {m.get('deepmd_torch')})"
    load = report["load_average"]
    lines = [
        f"{versions}, torch {m['torch']}; {m['cpu']}, {m['usable_cores']} of {m['cores']} "
        f"cores, {m['memory_gib']} GiB; {report['date']}",
        f"data: {report['input']}; threads per process: {s['threads']}; batch 1; "
        f"{s['steps']} steps after {s['warmup']} of warm-up; {s['repeat']} round(s)"
        f"{', alternating' if dp else ''}; load average {load['before'][0]:.2f} before, "
        f"{load['after'][0]:.2f} after",
        "",
    ]
    header = ["measurement", "mdtrain"] + (["DeePMD-kit", "DeePMD-kit / mdtrain"] if dp else [])
    lines += ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for r in report["table"]:
        cells = [f"{r['what']} ({r['unit']})", _cell(r["mdtrain"])]
        if dp:
            cells += [_cell(r["deepmd"]), "—" if r["ratio"] is None else f"{_num(r['ratio'])}×"]
        lines.append("| " + " | ".join(cells) + " |")
    notes = []
    if dp:
        notes.append("Ratios: DeePMD-kit's time or memory over mdtrain's (for frames/s, "
                     "mdtrain's rate over DeePMD-kit's), median of the rounds; above 1, "
                     "mdtrain is faster or smaller.")  # fmt: skip
    nstat = report["parts"].get("neighbor-stat", {})
    md_runs = nstat.get("results", {}).get("mdtrain")
    if isinstance(md_runs, list) and md_runs:
        first, agree = md_runs[0], nstat["agree"]
        dist = first["min_nbor_dist"]
        said = {None: "", True: "; DeePMD-kit finds the same", False: "; DeePMD-kit DIFFERS"}
        notes.append(f"Neighbour statistics: min_nbor_dist "
                     f"{'undefined' if dist is None else f'{dist:.6f} Å'}, max_nbor_size "
                     f"{first['max_nbor_size']}{said[agree]}.")  # fmt: skip
    ranks = report["parts"].get("ranks", {})
    if "speedup_2_ranks" in ranks:
        notes.append(f"2 ranks × 1 thread: {ranks['speedup_2_ranks']:.2f}× the frames/s of "
                     "1 rank × 2 threads.")  # fmt: skip
    if ranks.get("deepmd"):
        notes.append(f"DeePMD-kit, 2 ranks: {ranks['deepmd']}.")
    return "\n".join(lines + ([""] + notes if notes else []))
