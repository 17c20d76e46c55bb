"""The comparer's picture for a person: one self-contained HTML file with inline SVG.

A step x point divergence map (each cell the tensors of that step and point: coloured by
their worst status, red deepening with the fraction of differing elements; files: one
cell per tensor) and the same map per tensor, the first divergence outlined, then a
log2-bucket histogram of ulp distances for each differing tensor of an ulp-aware dtype,
and a table of the tensors that are not identical. No scripts, styles or images from
elsewhere.
"""

from __future__ import annotations

import html
import math
import os

__all__ = ["write_report"]

MAX_HISTOGRAMS = 60
MAX_ROWS = 300
_RANK = {"identical": 0, "within_tolerance": 1, "different": 2, "missing_in_a": 3,
         "missing_in_b": 3, "shape_mismatch": 4, "dtype_mismatch": 4}
_FIXED = {"identical": "#2e7d32", "within_tolerance": "#c0ca33", "missing_in_a": "#9e9e9e",
          "missing_in_b": "#9e9e9e", "shape_mismatch": "#6a1b9a", "dtype_mismatch": "#6a1b9a"}


def _red(fraction: float) -> str:
    """Returns a red whose depth grows with the fraction of differing elements (sqrt scale)."""
    t = math.sqrt(max(0.0, min(1.0, fraction)))
    lo, hi = (0xff, 0xcd, 0xd2), (0xb7, 0x1c, 0x1c)
    return "#" + "".join(f"{round(l + (h - l) * t):02x}" for l, h in zip(lo, hi))


def _colour(status: str, fraction) -> str:
    """Returns a cell's fill for its worst status and differing fraction."""
    if status == "different":
        return _red(fraction or 0.0)
    return _FIXED[status]


def _e(x) -> str:
    """HTML-escapes str(x) ('' for None)."""
    return "" if x is None else html.escape(str(x), quote=True)


def _cells(result, kind, by_tensor):
    """Returns (columns, rows, {(row, col): aggregate}) of a map by point or by tensor."""
    agg, cols, rows = {}, [], []
    for t in result["tensors"]:
        if kind == "recording":
            col, row = t["step"], t["point"]
            if by_tensor:
                row = f"{t['point']}/{t['name']}" + (f" rank {t['rank']}" if t["rank"] else "")
        else:
            col, row = "file", t["name"]
        if col not in cols:
            cols.append(col)
        if row not in rows:
            rows.append(row)
        a = agg.setdefault((row, col), {"status": "identical", "differing": 0, "elements": 0,
                                        "tensors": 0, "bad": 0})
        a["tensors"] += 1
        if _RANK[t["status"]] > _RANK[a["status"]]:
            a["status"] = t["status"]
        if t["differing"] is not None:
            a["differing"] += t["differing"]
            a["elements"] += t["elements"]
        if t["status"] != "identical":
            a["bad"] += 1
    if kind == "recording":
        cols.sort()
    return cols, rows, agg


def _map_svg(result, kind, by_tensor=False) -> str:
    """Returns a divergence map as an SVG element (the first MAX_ROWS rows)."""
    cols, rows, agg = _cells(result, kind, by_tensor)
    rows = rows[:MAX_ROWS]
    if not cols or not rows:
        return "<p>No tensors.</p>"
    cw = max(6, min(44, 900 // max(1, len(cols))))
    ch = 18
    left = min(360, 12 + 7 * max(len(str(r)) for r in rows))
    top = 40
    w, h = left + cw * len(cols) + 10, top + ch * len(rows) + 10
    fd = result["first_divergence"]
    first = None
    if fd is not None:
        first = (fd["point"], fd["step"]) if kind == "recording" else (fd["name"], "file")
        if by_tensor and kind == "recording":
            first = (f"{fd['point']}/{fd['name']}" + (f" rank {fd['rank']}" if fd["rank"]
                                                      else ""), fd["step"])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" '
           f'font-family="monospace" font-size="11">']
    label_every = max(1, math.ceil(40 / cw))
    for j, c in enumerate(cols):
        if j % label_every == 0:
            x = left + j * cw + cw / 2
            out.append(f'<text x="{x:.1f}" y="{top - 6}" text-anchor="middle">{_e(c)}</text>')
    out.append(f'<text x="{left}" y="12">{"step" if kind == "recording" else ""}</text>')
    for i, r in enumerate(rows):
        y = top + i * ch
        out.append(f'<text x="{left - 6}" y="{y + ch - 5}" text-anchor="end">{_e(r)}</text>')
        for j, c in enumerate(cols):
            a = agg.get((r, c))
            if a is None:
                continue
            frac = a["differing"] / a["elements"] if a["elements"] else 0.0
            x = left + j * cw
            stroke = ' stroke="#000" stroke-width="2"' if first == (r, c) else \
                ' stroke="#fff" stroke-width="0.5"'
            what = "tensor" if by_tensor else "point"
            tip = (f"step {c}, {what} {r}: {a['status']}; {a['bad']} of {a['tensors']} tensors "
                   f"not identical; {a['differing']} of {a['elements']} elements differ "
                   f"({frac:.3%})") if kind == "recording" else (
                   f"{r}: {a['status']}; {a['differing']} of {a['elements']} elements differ "
                   f"({frac:.3%})")
            out.append(f'<rect class="cell" x="{x}" y="{y}" width="{cw}" height="{ch}" '
                       f'fill="{_colour(a["status"], frac)}"{stroke}>'
                       f'<title>{_e(tip)}</title></rect>')
    out.append("</svg>")
    return "".join(out)


def _legend_svg() -> str:
    """Returns the map's colour legend."""
    items = [("identical", _FIXED["identical"]), ("within tolerance", _FIXED["within_tolerance"]),
             ("1% differ", _red(0.01)), ("25% differ", _red(0.25)), ("all differ", _red(1.0)),
             ("missing", _FIXED["missing_in_a"]), ("mismatch", _FIXED["shape_mismatch"])]
    out = ['<svg xmlns="http://www.w3.org/2000/svg" width="900" height="24" '
           'font-family="sans-serif" font-size="11">']
    x = 4
    for label, fill in items:
        out.append(f'<rect x="{x}" y="5" width="14" height="14" fill="{fill}"/>'
                   f'<text x="{x + 18}" y="16">{_e(label)}</text>')
        x += 24 + 7 * len(label)
    out.append("</svg>")
    return "<div>" + "".join(out) + "</div>"


def _bucket_label(k: int) -> str:
    """Returns the range of log2 bucket k: 0, 1, 2-3, 4-7, ..."""
    if k == 0:
        return "0"
    lo, hi = 1 << (k - 1), (1 << k) - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


def _hist_svg(hist) -> str:
    """Returns one tensor's ulp histogram (log2 buckets, bar height ~ log of the count)."""
    top_k = max(3, max(k for k, n in enumerate(hist) if n) + 1)
    bw, hh, base = 30, 80, 100
    w = max(440, 60 + bw * top_k)
    biggest = max(int(n) for n in hist)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{base + 62}" '
           f'font-family="monospace" font-size="10">',
           f'<text x="30" y="{base + 56}">ulp distance (log2 buckets); bar height: log of the '
           'element count</text>']
    for k in range(top_k):
        n = int(hist[k])
        x = 30 + k * bw
        bar = 0 if n == 0 else max(2.0, hh * math.log1p(n) / math.log1p(biggest))
        out.append(f'<rect x="{x}" y="{base - bar:.1f}" width="{bw - 3}" height="{bar:.1f}" '
                   f'fill="#c62828"><title>{_e(_bucket_label(k))} ulps: {n} elements'
                   f'</title></rect>')
        if n:
            out.append(f'<text x="{x + (bw - 3) / 2:.1f}" y="{base - bar - 3:.1f}" '
                       f'text-anchor="middle">{n}</text>')
        out.append(f'<text x="{x + (bw - 3) / 2:.1f}" y="{base + 12}" text-anchor="middle" '
                   f'transform="rotate(35 {x + (bw - 3) / 2:.1f} {base + 12})">'
                   f'{_e(_bucket_label(k))}</text>')
    out.append(f'<line x1="28" y1="{base}" x2="{w - 6}" y2="{base}" stroke="#333"/></svg>')
    return "".join(out)


def _where(t) -> str:
    """Returns a tensor's place: 'step S rank R point/name' (files: the name)."""
    if t["step"] is None:
        return t["name"]
    return f"step {t['step']} rank {t['rank']} {t['point']}/{t['name']}"


def write_report(path, result, extras, kind, a, b, max_ulps) -> None:
    """Writes the HTML report of a comparison to `path` (replacing it)."""
    s = result["summary"]
    fd = result["first_divergence"]
    if fd is None:
        verdict = "identical" if result["identical"] else f"within {max_ulps} ulps"
    elif kind == "recording":
        verdict = (f"first divergence: step {fd['step']}, point {fd['point']}, name "
                   f"{fd['name']}, rank {fd['rank']}")
    else:
        verdict = f"first divergence: tensor {fd['name']}"
    parts = ["<!DOCTYPE html><html><head><meta charset=\"utf-8\"><title>stepcore.diff "
             "report</title></head><body style=\"font-family:sans-serif;margin:20px\">",
             "<h1>stepcore.diff</h1>",
             f"<p>A: <code>{_e(a)}</code><br>B: <code>{_e(b)}</code><br>max ulps: "
             f"{max_ulps}</p>",
             f"<p><b>{_e(verdict)}</b></p>",
             "<p>" + ", ".join(f"{_e(k)} {v}" for k, v in s.items()) + "</p>",
             "<h2>Divergence map</h2>",
             "<p>Each cell: the tensors of one step and point (all names and ranks), "
             "coloured by their worst status: green identical, olive within tolerance, red "
             "different (deeper with the fraction of differing elements), grey missing, "
             "purple shape or dtype mismatch. The first divergence is outlined; hover for "
             "counts.</p>",
             _map_svg(result, kind), _legend_svg()]
    if kind == "recording":
        parts += ["<h2>Step x tensor</h2>",
                  f"<p>The same per tensor (the first {MAX_ROWS} tensors, in A's order).</p>",
                  _map_svg(result, kind, by_tensor=True)]
    shown = 0
    hists = []
    for t, x in zip(result["tensors"], extras):
        if x["hist"] is not None and shown < MAX_HISTOGRAMS:
            shown += 1
            hists.append(f"<h3>{_e(_where(t))}</h3><p>{t['differing']} of {t['elements']} "
                         f"elements differ; max {t['max_ulps']} ulps, lower median "
                         f"{t['median_ulps']}</p>{_hist_svg(x['hist'])}")
    parts.append("<h2>Ulp distances of differing tensors</h2>")
    parts.append("<p>Buckets by powers of two of the distance; NaN pairs have none. "
                 f"First {MAX_HISTOGRAMS} tensors.</p>" if hists else "<p>None.</p>")
    parts.extend(hists)
    parts.append("<h2>Tensors not identical</h2><table border=\"1\" cellspacing=\"0\" "
                 "cellpadding=\"3\" style=\"border-collapse:collapse;font-size:12px\"><tr>"
                 "<th>where</th><th>status</th><th>dtype</th><th>shape</th><th>differing"
                 "</th><th>max ulps</th><th>median ulps</th><th>first index</th><th>A</th>"
                 "<th>B</th></tr>")
    rows = 0
    for t, x in zip(result["tensors"], extras):
        if t["status"] == "identical" or rows >= MAX_ROWS:
            continue
        rows += 1
        shape = _e(t["shape"])
        if t["status"] in ("shape_mismatch", "dtype_mismatch"):
            shape = _e(f"A {x['a'][0]} {x['a'][1]}, B {x['b'][0]} {x['b'][1]}")
        parts.append("<tr>" + "".join(f"<td>{c}</td>" for c in (
            _e(_where(t)), _e(t["status"]), _e(t["dtype"]), shape,
            "" if t["differing"] is None else f"{t['differing']} ({t['fraction']:.3%})",
            _e(t["max_ulps"]), _e(t["median_ulps"]), _e(t["first_index"]),
            _e(f"{t['a_hex']} ({t['a_value']})" if t["a_hex"] else ""),
            _e(f"{t['b_hex']} ({t['b_value']})" if t["b_hex"] else ""))) + "</tr>")
    parts.append("</table></body></html>\n")
    tmp = os.fspath(path) + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))
    os.replace(tmp, path)
