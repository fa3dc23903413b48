"""What the what-if prints: a table, the --json document, the --plot PNG."""

from __future__ import annotations

import json
from collections.abc import Sequence

from maru_dynamo.components.whatif.runner import Row


def _num(v: float | int | None, fmt: str) -> str:
    return "failed" if v is None else format(v, fmt)


def table(rows: Sequence[Row], sweep: bool = False) -> str:
    head = (
        ["workers", "config"]
        + (["weight"] if sweep else [])
        + ["TTFT p50 ms", "TTFT p90 ms", "prefill tokens", "of input", "vs kv-gpu", "out tok/s", "runs", "failed"]
    )
    gpu = {r.workers: r.prefill_tokens for r in rows if r.config == "kv-gpu" and r.prefill_tokens}
    lines = []
    for r in rows:
        share = f"{r.prefill_tokens / r.input_tokens:.3f}" if r.prefill_tokens is not None else "-"
        vs = f"{r.prefill_tokens / gpu[r.workers]:.3f}" if r.prefill_tokens is not None and r.workers in gpu else "-"
        lines.append(
            [str(r.workers), r.config]
            + ([f"{r.host_weight:g}"] if sweep else [])
            + [
                _num(r.ttft_p50_ms, ".0f"),
                _num(r.ttft_p90_ms, ".0f"),
                _num(r.prefill_tokens, ","),
                share,
                vs,
                _num(r.output_tokens_per_s, ".0f"),
                str(r.runs),
                str(r.failed_runs),
            ]
        )
    widths = [max(len(h), *(len(x[i]) for x in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    return "\n".join([fmt(head)] + [fmt(x) for x in lines])


def json_document(
    trace: str, requests: int, rows: Sequence[Row], sweep: bool = False, best: dict[int, Row] | None = None
) -> str:
    doc: dict[str, object] = {
        "trace": trace,
        "requests": requests,
        "results": [r.as_json(with_weight=sweep) for r in rows],
    }
    if best is not None:
        doc["best_host_weight"] = {str(w): r.host_weight for w, r in sorted(best.items())}
    return json.dumps(doc, indent=2)


def plot(rows: Sequence[Row], path: str, title: str) -> None:
    """TTFT p50/p90 and prefill tokens vs workers, one line per configuration."""
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("--plot needs matplotlib: run 'make setup' (the 'test' extra installs it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    configs = list(dict.fromkeys(r.config for r in rows))
    for config in configs:
        pts = sorted((r.workers, r) for r in rows if r.config == config and r.runs)
        if not pts:
            continue
        xs = [w for w, _ in pts]
        axes[0].plot(xs, [r.ttft_p50_ms for _, r in pts], marker="o", label=config)
        axes[1].plot(xs, [r.ttft_p90_ms for _, r in pts], marker="o", label=config)
        # rows with runs have prefill_tokens
        axes[2].plot(xs, [(r.prefill_tokens or 0) / r.input_tokens for _, r in pts], marker="o", label=config)
    for ax, label in zip(axes, ("TTFT p50 (ms)", "TTFT p90 (ms)", "prefill tokens computed / input tokens")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("workers")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        xs = sorted({r.workers for r in rows})
        ax.set_xticks(xs, [str(x) for x in xs])
    axes[0].set_yscale("log")
    axes[1].set_yscale("log")
    axes[2].legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
