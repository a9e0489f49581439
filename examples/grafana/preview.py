"""Draw the Grafana dashboard's panels from a Prometheus, as a static HTML page,
where no Grafana is at hand (docs/img/grafana-dashboard.png was made so).

    python examples/grafana/preview.py http://127.0.0.1:9090 preview.html --minutes 5

Each panel of ``celery-singleton-lock.json`` is placed by its ``gridPos`` and
drawn from its own PromQL, evaluated by that Prometheus (``query_range`` for
time series, an instant query for stat and bar gauge panels), with Grafana's
variables given their widest value: ``$task`` and ``$worker`` all, the range
the page's. The drawing (SVG lines, bars, a number) is this script's, not
Grafana's; the queries, titles, layout and legends are the dashboard's.
"""

from __future__ import annotations

import argparse
import html
import json
import re
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).with_name("celery-singleton-lock.json")
COLOURS = ["#73bf69", "#f2cc0c", "#5794f2", "#ff780a", "#f2495c", "#b877d9", "#8ab8ff",
           "#fade2a"]
ROW_PX = 30  # Grafana's height of one grid unit


def expand(expr: str, seconds: int, rate: int) -> str:
    """The dashboard's variables as Grafana gives them with "All" chosen."""
    return (expr.replace("$__rate_interval", f"{rate}s").replace("$__range", f"{seconds}s")
            .replace("$task", ".*").replace("$worker", ".*"))


def ask(prometheus: str, path: str, **params: Any) -> list[dict[str, Any]]:
    url = f"{prometheus}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=10) as reply:
        answer = json.loads(reply.read())
    if answer.get("status") != "success":
        raise RuntimeError(f"{path} {params}: {answer}")
    return list(answer["data"]["result"])


def legend(fmt: str, labels: dict[str, str]) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), fmt) or str(labels)


def number(value: float, unit: str) -> str:
    if value != value:  # NaN: no data in a quantile
        return "-"
    if unit == "s":
        return f"{value * 1000:.2f} ms" if value < 1 else f"{value:.2f} s"
    if unit == "ops":
        return f"{value:.2f}/s"
    return f"{value:.0f}" if abs(value - round(value)) < 1e-9 else f"{value:.2f}"


def series_svg(series: list[tuple[str, list[tuple[float, float]]]], unit: str, w: int,
               h: int) -> str:
    points = [p for _, pts in series for p in pts if p[1] == p[1]]
    if not points:
        return f'<div class="nodata" style="height:{h}px">No data</div>'
    t0, t1 = min(p[0] for p in points), max(p[0] for p in points)
    top = max(max(p[1] for p in points), 1e-9) * 1.1
    lines = []
    for n, (_, pts) in enumerate(series):
        xy = " ".join(f"{62 + (t - t0) / max(t1 - t0, 1) * (w - 72):.1f},"
                      f"{h - 18 - v / top * (h - 28):.1f}" for t, v in pts if v == v)
        lines.append(f'<polyline fill="none" stroke="{COLOURS[n % len(COLOURS)]}" '
                     f'stroke-width="1.6" points="{xy}"/>')
    grid = "".join(f'<line x1="62" x2="{w - 10}" y1="{h - 18 - f * (h - 28):.1f}" '
                   f'y2="{h - 18 - f * (h - 28):.1f}" stroke="#2c3235"/>'
                   f'<text x="58" y="{h - 14 - f * (h - 28):.1f}" text-anchor="end">'
                   f'{html.escape(number(top * f, unit))}</text>' for f in (0, 0.5, 1))
    clock = "".join(f'<text x="{62 + f * (w - 72):.1f}" y="{h - 2}" text-anchor="middle">'
                    f'{time.strftime("%H:%M:%S", time.localtime(t0 + f * (t1 - t0)))}</text>'
                    for f in (0, 0.5, 1))
    return f'<svg width="{w}" height="{h}">{grid}{clock}{"".join(lines)}</svg>'


def render(prometheus: str, minutes: float) -> str:
    dash = json.loads(DASHBOARD.read_text())
    end = time.time()
    seconds = int(minutes * 60)
    rate = 4 * 1  # four scrape intervals of the preview's Prometheus (1 s)
    cells = []
    for panel in dash["panels"]:
        pos = panel["gridPos"]
        style = (f"grid-column:{pos['x'] + 1}/span {pos['w']};"
                 f"grid-row:{pos['y'] + 1}/span {pos['h']}")
        if panel["type"] == "row":
            cells.append(f'<div class="row" style="{style}">{html.escape(panel["title"])}</div>')
            continue
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit", "short")
        width, height = pos["w"] * 66 - 24, pos["h"] * ROW_PX - 50
        body = ""
        if panel["type"] == "timeseries":
            series, rows = [], []
            for target in panel["targets"]:
                for item in ask(prometheus, "query_range", query=expand(
                        target["expr"], seconds, rate), start=end - seconds, end=end,
                        step=max(1, seconds // 150)):
                    name = legend(target.get("legendFormat", ""), item["metric"])
                    pts = [(float(t), float(v)) for t, v in item["values"]]
                    series.append((name, pts))
            for n, (name, pts) in enumerate(series):
                last = pts[-1][1] if pts else float("nan")
                top = max((v for _, v in pts if v == v), default=float("nan"))
                rows.append(f'<tr><td><i style="background:{COLOURS[n % len(COLOURS)]}"></i>'
                            f'{html.escape(name)}</td><td>{number(last, unit)}</td>'
                            f'<td>{number(top, unit)}</td></tr>')
            table = (f'<table><tr><th></th><th>last</th><th>max</th></tr>{"".join(rows)}'
                     '</table>') if rows else ""
            body = (f'<div class="ts">{series_svg(series, unit, int(width * 0.62), height)}'
                    f'{table}</div>')
        else:
            values = []
            for target in panel["targets"]:
                for item in ask(prometheus, "query", query=expand(target["expr"], seconds, rate),
                                time=end):
                    values.append((legend(target.get("legendFormat", ""), item["metric"]),
                                   float(item["value"][1])))
            if panel["type"] == "stat":
                maps = panel["fieldConfig"]["defaults"].get("mappings", [])
                shown = [maps[0]["options"].get(str(int(v)), {}) if maps else {}
                         for _, v in values]
                body = "".join(f'<div class="stat" style="color:{m.get("color", "#73bf69")}">'
                               f'{html.escape(m.get("text", number(v, unit)))}</div>'
                               for (_, v), m in zip(values, shown)
                               ) or '<div class="nodata">No data</div>'
            else:
                top = max((v for _, v in values), default=1) or 1
                body = "".join(
                    f'<div class="bar"><span>{html.escape(name)}</span><b style="width:'
                    f'{max(v / top, 0.01) * 60:.1f}%"></b><em>{number(v, unit)}</em></div>'
                    for name, v in sorted(values, key=lambda x: -x[1])
                ) or '<div class="nodata">No data</div>'
        cells.append(f'<div class="panel" style="{style}"><h3>{html.escape(panel["title"])}'
                     f'</h3>{body}</div>')
    return PAGE.format(title=html.escape(dash["title"]), minutes=minutes,
                       cells="".join(cells), prometheus=html.escape(prometheus))


PAGE = """<!doctype html><html><head><meta charset="utf-8"><title>{title}</title><style>
body{{background:#111217;color:#ccccdc;font:12px Inter,Helvetica,Arial,sans-serif;margin:0;
padding:12px}}
header{{font-size:16px;margin:0 0 8px 4px}} header small{{color:#8e8e8e;font-size:11px}}
.grid{{display:grid;grid-template-columns:repeat(24,1fr);grid-auto-rows:{row}px;gap:6px}}
.row{{font-size:14px;font-weight:600;align-self:end}}
.panel{{background:#181b1f;border:1px solid #2c3235;border-radius:2px;padding:6px 8px;
overflow:hidden}}
.panel h3{{margin:0 0 4px;font-size:12px;font-weight:500}}
svg text{{fill:#8e8e8e;font-size:9px}} .ts{{display:flex;gap:6px}}
table{{font-size:10px;border-collapse:collapse}}
td,th{{padding:1px 4px;text-align:right;white-space:nowrap}} td:first-child{{text-align:left}}
i{{display:inline-block;width:10px;height:3px;margin-right:4px;vertical-align:middle}}
.stat{{font-size:44px;font-weight:600;text-align:center;margin-top:18px}}
.bar{{display:flex;align-items:center;gap:6px;margin:3px 0;font-size:11px}}
.bar span{{width:36%;overflow:hidden;text-overflow:ellipsis;white-space:nowrap}}
.bar b{{height:14px;background:linear-gradient(90deg,#73bf69,#f2cc0c)}} .bar em{{font-style:normal}}
.nodata{{color:#8e8e8e;display:flex;align-items:center;justify-content:center}}
</style></head><body><header>{title} <small>last {minutes:g} min, drawn from {prometheus}
by examples/grafana/preview.py (not Grafana's renderer)</small></header>
<div class="grid">{cells}</div></body></html>""".replace("{row}", str(ROW_PX))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prometheus")
    parser.add_argument("out", type=Path)
    parser.add_argument("--minutes", type=float, default=5.0)
    args = parser.parse_args()
    args.out.write_text(render(args.prometheus.rstrip("/"), args.minutes))


if __name__ == "__main__":
    main()
