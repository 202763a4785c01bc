"""Plot the curves of a run: ``python -m twinkle_metrics.integrations.plot RUN_DIR/metrics.jsonl [-o out.png]``.

One panel per numeric key, step on the x axis, written with matplotlib's Agg
backend (no display needed). Default output: ``metrics.png`` next to the JSONL.
"""
from __future__ import annotations

import argparse
import json
import math
import os
from typing import Dict, List, Optional, Sequence, Tuple

_SKIP = {"step", "time"}


def read_jsonl(path: str) -> List[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"plot: {path}:{line_no} is not JSON ({exc})") from exc
    return rows


def curves(rows: Sequence[dict]) -> Dict[str, Tuple[List[float], List[float]]]:
    """``{key: (steps, values)}`` for every numeric key, in first-seen order."""
    out: Dict[str, Tuple[List[float], List[float]]] = {}
    for row in rows:
        step = row.get("step")
        if step is None:
            continue
        for key, value in row.items():
            if key in _SKIP or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if isinstance(value, float) and not math.isfinite(value):
                continue
            xs, ys = out.setdefault(key, ([], []))
            xs.append(step)
            ys.append(value)
    return out


def plot(jsonl_path: str, out_path: Optional[str] = None, keys: Optional[Sequence[str]] = None,
         title: Optional[str] = None) -> str:
    """Write a PNG of the curves in ``jsonl_path``; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    data = curves(read_jsonl(jsonl_path))
    if keys:
        missing = [k for k in keys if k not in data]
        if missing:
            raise ValueError(f"plot: keys {missing} are not in {jsonl_path}; have {sorted(data)}")
        data = {k: data[k] for k in keys}
    if not data:
        raise ValueError(f"plot: {jsonl_path} has no numeric values to plot")
    out_path = out_path or os.path.join(os.path.dirname(os.path.abspath(jsonl_path)), "metrics.png")
    n = len(data)
    cols = min(3, n)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 2.8 * rows), squeeze=False)
    for ax, (key, (xs, ys)) in zip(axes.flat, data.items()):
        ax.plot(xs, ys, marker="o", markersize=2.5, linewidth=1.2)
        ax.set_title(key, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.suptitle(title or os.path.basename(os.path.dirname(os.path.abspath(jsonl_path))), fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jsonl", help="RUN_DIR/metrics.jsonl")
    parser.add_argument("-o", "--out", default=None, help="PNG path (default: metrics.png beside it)")
    parser.add_argument("--keys", nargs="*", default=None, help="only these keys")
    args = parser.parse_args(argv)
    print(plot(args.jsonl, args.out, args.keys))


if __name__ == "__main__":
    main()
