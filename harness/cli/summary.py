"""The short end-of-run table: per variant, how far it drifted and how that compares with the noise floor."""

from __future__ import annotations

import pandas as pd
from rich.table import Table

from harness.run.runner import YARDSTICK

SUMMARY_METRICS = [
    ("streams.rel_l2", "layer.out", "final-layer stream rel L2", "last"),
    ("attn.tv", "attn.probs", "attention TV, worst layer", "max"),
    ("indexer.recall", "indexer.selected", "indexer recall, worst layer", "min"),
    ("ctx.needle_recall", "indexer.selected", "needle recall, worst layer", "min"),
    ("logits.kl", "logits", "logits KL", "last"),
    ("logits.top1_agree", "logits", "top-1 agree", "last"),
]
"""(metric, tap, column, which layer): every value is a layer's count-weighted mean over its positions — what the
default gate judges — at the last layer (the logits row for logits metrics) or the worst layer."""


def summarize(metrics: pd.DataFrame) -> pd.DataFrame:
    """One row per (variant, phase): the SUMMARY_METRICS over global-mode rows."""
    g = metrics[metrics["mode"] == "global"]
    rows = []
    for (variant, phase), part in g.groupby(["variant", "phase"], sort=False):
        row = {"variant": variant, "phase": phase}
        for metric, tap, label, which in SUMMARY_METRICS:
            m = part[(part["metric"] == metric) & (part["tap"] == tap)]
            if m.empty:
                row[label] = float("nan")
                continue
            weighted = (m["value"] * m["count"]).groupby(m["layer"]).sum() / m["count"].groupby(m["layer"]).sum()
            row[label] = float({"last": weighted.iloc[-1], "max": weighted.max(), "min": weighted.min()}[which])
        rows.append(row)
    return pd.DataFrame(rows)


def summary_table(metrics: pd.DataFrame, title: str = "drift summary (global)") -> Table:
    df = summarize(metrics)
    table = Table(title=title)
    for col in df.columns:
        table.add_column(col, justify="left" if col in ("variant", "phase") else "right")
    yard = df[df["variant"] == YARDSTICK].set_index("phase") if YARDSTICK in set(df["variant"]) else None
    for _, r in df.iterrows():
        cells = [str(r["variant"]), str(r["phase"])]
        for col in df.columns[2:]:
            v = r[col]
            text = "—" if pd.isna(v) else f"{v:.3g}"
            if yard is not None and r["variant"] != YARDSTICK and col.startswith(("final", "attention")) \
                    and r["phase"] in yard.index and yard.loc[r["phase"], col] > 0:
                text += f" ({v / yard.loc[r['phase'], col]:.1f}× yd)"
            cells.append(text)
        table.add_row(*cells)
    return table
