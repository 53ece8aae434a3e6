"""`rpb inspect`'s outputs: inspect.json, inspect.md and inspect.html (its plots drawn as inline
SVG: matplotlib is the pipeline extra's, not the library's, and a page with inline SVG is one file
that opens anywhere)."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

# The scores of each cell and domain, with their units (the router-swap table's metrics).
METRICS = {
    "ll_per_token": "mean per-token log-likelihood of completion + EOS, nats",
    "p_target": "p(completion + EOS), percent",
    "exact_match": "completion + EOS is the greedy continuation, percent",
}
# The metric the page's decomposition bars show: on a tiny or a 30B model alike it moves where
# p(target) and exact match sit at zero.
PLOT_METRIC = "ll_per_token"


def _finite(value: Any) -> Any:
    """`value` with NaN and infinities as None, so inspect.json is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def write_outputs(result: Mapping[str, Any], out: Path) -> None:
    """inspect.json, inspect.md and inspect.html of `result` in `out`, each written atomically."""
    from rpb.artifacts import write_text

    out.mkdir(parents=True, exist_ok=True)
    clean = _finite(result)
    write_text(out / "inspect.json", json.dumps(clean, indent=2, allow_nan=False) + "\n")
    write_text(out / "inspect.md", markdown(clean))
    write_text(out / "inspect.html", page(clean))


# --- inspect.md -------------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 4) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.3e}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines


DRIFT_COLUMNS = {
    "layer": "MoE layer",
    "topk_overlap": "top-k overlap",
    "kl_to_base": "KL to base",
    "router_weight_change": "router change",
    "base_entropy": "base entropy",
    "tuned_entropy": "tuned entropy",
    "base_dead": "base dead",
    "tuned_dead": "tuned dead",
    "base_overloaded": "base overl.",
    "tuned_overloaded": "tuned overl.",
    "community_nmi": "community NMI",
    "coact_cosine": "co-act. cosine",
}


def _drift_columns(layers: Sequence[Mapping[str, Any]]) -> list[str]:
    return [c for c in DRIFT_COLUMNS if c in layers[0]]


def _summary_lines(result: Mapping[str, Any]) -> list[str]:
    inputs, model, mean = result["inputs"], result["model"], result["drift"]["mean"]
    lines = [
        f"`{inputs['tuned']['path']}` against its base `{inputs['base']['path']}` "
        f"({result['settings']['model_type']}: {model['moe_layers']} MoE layers of "
        f"{model['experts']} experts, top-{model['top_k']}, {model['routing']} routing), over "
        f"{inputs['data']['records']} records ({inputs['data']['tokens']} tokens) of "
        f"`{inputs['data']['path']}`.",
        "",
        f"Mean over layers: top-k overlap with the base router {_fmt(mean['topk_overlap'])}, "
        f"KL(base || tuned) {_fmt(mean['kl_to_base'])} nats, relative router weight change "
        f"{_fmt(mean['router_weight_change'])}"
        + (
            f", co-activation community NMI {_fmt(mean['community_nmi'])}."
            if "community_nmi" in mean
            else f". Communities: {result['drift']['communities']}."
        ),
    ]
    return lines


def effect_label(key: str) -> str:
    """A row name of the decomposition table for a key of rpb.router_swap.decompose."""
    if key == "total":
        return "total (tuned - base)"
    for prefix, what in (
        ("shapley_share_", "Shapley share"),
        ("shapley_", "Shapley value"),
        ("put_back_share_", "put-back share"),
        ("put_back_", "put back"),
        ("main_", "main effect"),
    ):
        if key.startswith(prefix):
            return f"{key.removeprefix(prefix)}: {what}"
    return key.removeprefix("interaction_").replace("_x_", " x ")


def decomposition_rows(per_metric: Mapping[str, Mapping[str, float]]) -> list[list[Any]]:
    """One domain's decomposition as rows: the effect, then its value under each metric."""
    keys = list(next(iter(per_metric.values())))
    return [[effect_label(k), *(per_metric[m][k] for m in per_metric)] for k in keys]


def _factor_lines(dec: Mapping[str, Any]) -> list[str]:
    units = "; ".join(f"{m}: {unit}" for m, unit in METRICS.items())
    lines = [f"Scores per cell ({units}) and the change split by part (rpb.router_swap)."]
    rest = {f: p for f, p in dec["factors"].items() if list(p) != [f]}
    if rest:
        lines[0] += " " + "; ".join(f"{f} = {' + '.join(p)}" for f, p in rest.items()) + "."
    return lines


def markdown(result: Mapping[str, Any]) -> str:
    """inspect.md: the summary, the per-layer drift table and each domain's decomposition."""
    layers = result["drift"]["layers"]
    columns = _drift_columns(layers)
    lines = ["# rpb inspect", "", *_summary_lines(result), "", "## Routing drift per MoE layer", ""]
    lines += _table([DRIFT_COLUMNS[c] for c in columns], [[r[c] for c in columns] for r in layers])
    lines += [
        "",
        "Top-k overlap and KL: the tuned model's routing against the base router's on the tuned "
        "model's own hidden states. Entropy: of expert usage, normalised by log E. Dead: experts "
        f"never selected; overloaded: above {result['drift']['overload_factor']:g}x the uniform "
        "share.",
    ]
    dec = result["decomposition"]
    if dec is None:
        lines += ["", "No --eval files: the change was not priced by part."]
        return "\n".join(lines) + "\n"
    lines += ["", "## The change by part", "", *_factor_lines(dec)]
    for domain, per_metric in dec["effects"].items():
        lines += ["", f"### {domain}", ""]
        lines += _table(
            ["cell", *METRICS],
            [[c, *(dec["scores"][c][domain][m] for m in METRICS)] for c in dec["cells"]],
        )
        lines += ["", *_table(["effect", *per_metric], decomposition_rows(per_metric))]
    return "\n".join(lines) + "\n"


# --- inspect.html -----------------------------------------------------------------------------

STYLE = """<style>
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; font-size: 14px;
  margin: 1.2em; color: #1f2328; max-width: 80em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.4em; } h3 { font-size: 1em; }
table { border-collapse: collapse; margin: 0.4em 0 1em; }
th, td { border: 1px solid #d0d7de; padding: 3px 7px; }
th { background: #f6f8fa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
figure { margin: 0.6em 0 1.2em; } figcaption { color: #57606a; max-width: 60em; }
svg text { font: 11px system-ui, sans-serif; fill: #1f2328; }
</style>"""
COLORS = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#57606a")


def _esc(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _scale(lo: float, hi: float, size: float) -> Callable[[float], float]:
    span = hi - lo if hi > lo else 1.0
    return lambda v: (v - lo) / span * size


def bar_chart(
    groups: Sequence[str],
    series: Mapping[str, Sequence[float | None]],
    *,
    title: str,
    height: int = 180,
) -> str:
    """Grouped vertical bars: one group per label of `groups`, one bar per series, zero line and
    the value range on the axis."""
    values = [v for vals in series.values() for v in vals if v is not None]
    lo, hi = min([0.0, *values]), max([0.0, *values])
    if hi == lo:
        hi = lo + 1.0
    n = max(len(series), 1)
    # Wide groups where there are few of them (two domains, two layers), narrow where many.
    group_w = max(14 * n + 8, min(30 * n + 20, 600 // max(len(groups), 1)))
    left, top, bottom = 56, 22, 34
    legend_w = sum(30 + 7 * len(name) for name in series)
    width = max(left + group_w * len(groups) + 10, left + legend_w)
    y = _scale(lo, hi, height)
    zero = top + height - y(0.0)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{top + height + bottom}"'
        f' role="img" aria-label="{_esc(title)}">',
        f'<text x="{left}" y="14">{_esc(title)}</text>',
        f'<line x1="{left}" x2="{left + group_w * len(groups)}" y1="{zero:.1f}" '
        f'y2="{zero:.1f}" stroke="#57606a"/>',
        f'<text x="{left - 4}" y="{top + 4}" text-anchor="end">{_fmt(hi, 3)}</text>',
        f'<text x="{left - 4}" y="{top + height}" text-anchor="end">{_fmt(lo, 3)}</text>',
    ]
    bar_w = (group_w - 8) / n
    for g, label in enumerate(groups):
        x0 = left + g * group_w + 4
        for s, (name, vals) in enumerate(series.items()):
            v = vals[g]
            if v is None:
                continue
            y_top = top + height - y(max(v, 0.0))
            h = abs(y(v) - y(0.0))
            parts.append(
                f'<rect x="{x0 + s * bar_w:.1f}" y="{y_top:.1f}" width="{bar_w - 1:.1f}" '
                f'height="{max(h, 0.5):.1f}" fill="{COLORS[s % len(COLORS)]}">'
                f"<title>{_esc(name)} {_esc(label)}: {_fmt(v)}</title></rect>"
            )
        parts.append(
            f'<text x="{x0 + (group_w - 8) / 2:.1f}" y="{top + height + 14}" '
            f'text-anchor="middle">{_esc(label)}</text>'
        )
    legend_x = left
    for s, name in enumerate(series):
        parts.append(
            f'<rect x="{legend_x}" y="{top + height + 22}" width="10" height="10" '
            f'fill="{COLORS[s % len(COLORS)]}"/>'
            f'<text x="{legend_x + 14}" y="{top + height + 31}">{_esc(name)}</text>'
        )
        legend_x += 30 + 7 * len(name)
    return "\n".join([*parts, "</svg>"])


def usage_heatmap(shares: Sequence[Sequence[float]], title: str) -> str:
    """Layers (rows) by experts (columns), coloured by log2 of the usage share over uniform:
    blue below it, red above, white at it; dead experts grey."""
    layers, experts = len(shares), len(shares[0])
    cell = max(4, min(32, 640 // experts))
    width = max(40 + cell * experts + 10, 7 * len(title) + 50, 460)
    left, top = 40, 22
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" '
        f'height="{top + cell * layers + 20}" role="img" aria-label="{_esc(title)}">',
        f'<text x="{left}" y="14">{_esc(title)}</text>',
    ]
    for layer, row in enumerate(shares):
        parts.append(
            f'<text x="{left - 4}" y="{top + cell * layer + cell - 2}" text-anchor="end">'
            f"{layer}</text>"
        )
        for expert, share in enumerate(row):
            if share <= 0:
                color = "#d0d7de"
            else:
                t = max(-1.0, min(1.0, math.log2(share * experts) / 2))  # +-2 = 4x
                fade = int(255 * (1 - abs(t)))
                color = f"rgb(255,{fade},{fade})" if t > 0 else f"rgb({fade},{fade},255)"
            parts.append(
                f'<rect x="{left + cell * expert}" y="{top + cell * layer}" width="{cell}" '
                f'height="{cell}" fill="{color}"><title>layer {layer} expert {expert}: '
                f"{100 * share:.2f}%</title></rect>"
            )
    parts.append(f'<text x="{left}" y="{top + cell * layers + 14}">experts 0..{experts - 1}</text>')
    return "\n".join([*parts, "</svg>"])


def _code_spans(text: str) -> str:
    """Escaped text with its `code` spans (the summary marks paths with backticks)."""
    pieces = _esc(text).split("`")
    return "".join(f"<code>{p}</code>" if i % 2 else p for i, p in enumerate(pieces))


def _html_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{_esc(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f'<td class="num">{_esc(_fmt(v))}</td>'
            if isinstance(v, (int, float)) or v is None
            else f"<td>{_esc(v)}</td>"
            for v in row
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure(svg: str, caption: str) -> str:
    return f"<figure>{svg}<figcaption>{_esc(caption)}</figcaption></figure>"


def page(result: Mapping[str, Any]) -> str:
    """inspect.html: the summary, the plots (drift per layer, usage per expert, the change by
    part as bars) and the tables of inspect.md."""
    layers = result["drift"]["layers"]
    labels = [str(r["layer"]) for r in layers]
    body = [
        "<h1>rpb inspect</h1>",
        *(f"<p>{_code_spans(line)}</p>" for line in _summary_lines(result) if line),
        "<h2>Routing drift per MoE layer</h2>",
        _figure(
            bar_chart(
                labels,
                {
                    "1 - top-k overlap": [1 - r["topk_overlap"] for r in layers],
                    "KL(base||tuned)": [r["kl_to_base"] for r in layers],
                    "router weight change": [r["router_weight_change"] for r in layers],
                },
                title="drift per MoE layer (0: the base's routing)",
            ),
            "Per MoE layer: the share of top-k choices that differ from the base router's on the "
            "tuned model's hidden states, KL of the routing distributions (nats) and the router "
            "weight's relative change ||W - W0|| / ||W0||.",
        ),
    ]
    if "community_nmi" in layers[0]:
        body.append(
            _figure(
                bar_chart(
                    labels,
                    {
                        "community NMI": [r["community_nmi"] for r in layers],
                        "co-activation cosine": [r["coact_cosine"] for r in layers],
                    },
                    title="co-activation structure kept (1: the base's)",
                ),
                "NMI of the tuned and base co-activation communities (Louvain) and the cosine of "
                "their co-activation counts, per MoE layer.",
            )
        )
    columns = _drift_columns(layers)
    body.append(
        _html_table([DRIFT_COLUMNS[c] for c in columns], [[r[c] for c in columns] for r in layers])
    )
    body += [
        "<h2>Expert usage</h2>",
        _figure(
            usage_heatmap(result["usage"]["base"], "base: usage share per expert")
            + usage_heatmap(result["usage"]["tuned"], "tuned: usage share per expert"),
            "Share of top-k selections each expert receives over --data, per MoE layer (rows), "
            "against the uniform share 1/E: blue below it, red above (4x saturates), grey for a "
            "dead expert; hover a cell for its share.",
        ),
    ]
    dec = result["decomposition"]
    if dec is None:
        body.append("<h2>The change by part</h2><p>No --eval files: not priced by part.</p>")
    else:
        names = list(dec["factors"])
        domains = list(dec["effects"])
        body += [
            "<h2>The change by part</h2>",
            *(f"<p>{_esc(line)}</p>" for line in _factor_lines(dec)),
            f"<p>Bars: {_esc(METRICS[PLOT_METRIC])}: each factor's Shapley value (they add up to "
            "the total change) and its put-back effect (putting the base's part back into the "
            "tuned model), per --eval domain.</p>",
            _figure(
                bar_chart(
                    domains,
                    {
                        "total": [dec["effects"][d][PLOT_METRIC]["total"] for d in domains],
                        **{
                            f"Shapley {f}": [
                                dec["effects"][d][PLOT_METRIC][f"shapley_{f}"] for d in domains
                            ]
                            for f in names
                        },
                    },
                    title=f"change tuned - base by part ({PLOT_METRIC})",
                ),
                "The total change and its split into the factors' Shapley values.",
            ),
            _figure(
                bar_chart(
                    domains,
                    {
                        f"put back {f}": [
                            dec["effects"][d][PLOT_METRIC][f"put_back_{f}"] for d in domains
                        ]
                        for f in names
                    },
                    title=f"putting the base's part back into the tuned model ({PLOT_METRIC})",
                ),
                "v(tuned with the base's part) - v(tuned): what putting each part back undoes.",
            ),
        ]
        for domain in domains:
            body.append(f"<h3>{_esc(domain)}</h3>")
            body.append(
                _html_table(
                    ["cell", *METRICS],
                    [[c, *(dec["scores"][c][domain][m] for m in METRICS)] for c in dec["cells"]],
                )
            )
            per_metric = dec["effects"][domain]
            body.append(_html_table(["effect", *per_metric], decomposition_rows(per_metric)))
    inputs = result["inputs"]
    provenance = [
        ["rpb", result["rpb_version"]],
        ["--data sha256", inputs["data"]["sha256"]],
        *(["--eval " + e["domain"] + " sha256", e["sha256"]] for e in inputs["eval"]),
    ]
    body += ["<h2>Inputs</h2>", _html_table(["what", "value"], provenance),
             "<p>Every number and every file's sha256: inspect.json.</p>"]  # fmt: skip
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>rpb inspect</title>{STYLE}</head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )
