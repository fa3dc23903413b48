"""Draw docs/design-request-flow.png: the data flow of one request through a Maru graph.

Documentation tooling, not part of the package. Rerun after changing what the picture shows:

    .venv/bin/python docs/design_diagram.py            # writes docs/design-request-flow.png
    .venv/bin/python docs/design_diagram.py --out X.png

Every name in the picture is a name in the code (see docs/design.md, which walks through the
numbered steps). Only matplotlib is needed (the `test` extra installs it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - after choosing the non-interactive backend
from matplotlib.axes import Axes  # noqa: E402
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "design-request-flow.png"

# One colour per kind of part, one line style per plane.
FILL = {
    "dynamo": "#e3f2fd",
    "vllm": "#fff3e0",
    "maru": "#e8f5e9",
    "pool": "#fce4ec",
    "region": "#f3e5f5",
    "nats": "#ede7f6",
    "client": "#eeeeee",
    "panel": "#fafafa",
}
EDGE = "#37474f"
REQUEST = dict(color="#1565c0", lw=2.0, ls="-")  # request / response (HTTP, Dynamo request plane)
CONTROL = dict(color="#c62828", lw=1.6, ls="--")  # pool control plane: unix socket, small msgpack frames
DATA = dict(color="#2e7d32", lw=4.0, ls="-")  # data plane: KV pages copied through the shared mapping
EVENTS = dict(color="#6a1b9a", lw=1.6, ls=":")  # events: pool events and KV events over NATS, ZMQ in-host


def box(ax: Axes, x: float, y: float, w: float, h: float, title: str, lines: tuple[str, ...] = (),
        kind: str = "maru", title_size: float = 10.5, size: float = 8.6, z: int = 2) -> None:
    """A rounded box with a bold title on top and plain lines under it."""
    ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.25,rounding_size=0.8",
                                fc=FILL[kind], ec=EDGE, lw=1.1, zorder=z))
    ax.text(x + 0.8, y + h - 0.9, title, ha="left", va="top", fontsize=title_size, fontweight="bold",
            zorder=z + 1)
    for i, line in enumerate(lines):
        ax.text(x + 0.8, y + h - 3.2 - i * 1.75, line, ha="left", va="top", fontsize=size, zorder=z + 1,
                family="DejaVu Sans")


def arrow(ax: Axes, start: tuple[float, float], end: tuple[float, float], style: dict, *,
          label: str = "", step: str = "", rad: float = 0.0, label_at: float = 0.5,
          label_dx: float = 0.0, label_dy: float = 0.0, both: bool = False, ha: str = "center") -> None:
    """An arrow from start to end in a plane's style, with an optional step number and label."""
    ax.add_patch(FancyArrowPatch(start, end, arrowstyle="<|-|>" if both else "-|>", mutation_scale=14,
                                 connectionstyle=f"arc3,rad={rad}", color=style["color"], lw=style["lw"],
                                 ls=style["ls"], zorder=6, shrinkA=2, shrinkB=2))
    mx = start[0] + (end[0] - start[0]) * label_at + label_dx
    my = start[1] + (end[1] - start[1]) * label_at + label_dy
    text = f"{label}" if label else ""
    if step:
        ax.text(mx, my, step, ha="center", va="center", fontsize=9, fontweight="bold", color="white", zorder=9,
                bbox=dict(boxstyle="circle,pad=0.25", fc=style["color"], ec="none"))
        mx += 1.6 if ha == "left" else 0
        my -= 0 if ha == "left" else 2.0
    if text:
        ax.text(mx, my, text, ha=ha, va="center", fontsize=8.2, color=style["color"], zorder=9,
                bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.9))


def draw(out: Path) -> None:
    fig, ax = plt.subplots(figsize=(17, 12.5))
    ax.set_xlim(0, 100)
    ax.set_ylim(0, 100)
    ax.axis("off")
    ax.text(50, 99.2, "maru-dynamo: one request, from the client through the router, a worker and the pool, "
            "and back to the router as events", ha="center", va="top", fontsize=13.5, fontweight="bold")

    # ---- top row: client, frontend with the KV router, NATS -------------------------------------
    box(ax, 1, 84, 11, 11, "Client", ("OpenAI API", "over HTTP"), kind="client")
    box(ax, 17, 80, 41, 15, "Dynamo frontend", (
        "python -m maru_dynamo.components.frontend  =  dynamo.frontend --router-mode kv",
        "KV router: a radix tree of block hashes per worker, fed by KV events",
        "  device tier: the worker's own prefix cache",
        "  host tier (CPU_PINNED): pool blocks, credited x --router-host-cache-hit-weight",
        "2  lowest cost wins: blocks left to prefill after the device and the (weighted)",
        "    pool overlap, plus the worker's in-flight blocks",
    ), kind="dynamo")
    box(ax, 62, 80, 37, 15, "nats-server", (
        "maru.<pool>.events: pool events (PoolEventMsg, JSON, gap-free seq)",
        "maru.<pool>.snapshot: paged snapshot on request (resync)",
        "Dynamo event plane (DYN_EVENT_PLANE=nats):",
        "  every worker's KV events reach every KV router",
    ), kind="nats")

    # ---- worker A: the process python -m maru_dynamo.components.maru_worker --------------------
    box(ax, 1, 32.5, 60, 44.5, "Worker A", (), kind="panel", z=1)
    ax.text(60.2, 76.6, "python -m maru_dynamo.components.maru_worker  (dynamo.vllm + Maru)", ha="right", va="top",
            fontsize=8.6, zorder=3)
    box(ax, 3, 59, 14, 14.5, "dynamo.vllm", ("handler:", "request plane", "(main process)"), kind="dynamo")
    box(ax, 19, 59, 18, 14.5, "Dynamo", ("KvEventPublisher", "reads the relay's", "stream instead of", "vLLM's"),
        kind="dynamo")
    box(ax, 39, 59, 20, 14.5, "KvEventRelay", (
        "set up in Dynamo's seam",
        "setup_kv_event_publisher;",
        "vLLM's batches pass through,",
        "pool chunks become",
        "BlockStored / BlockRemoved",
        "at CPU_PINNED",
    ), kind="maru")
    box(ax, 3, 34, 56, 21.5, "vLLM engine (EngineCore + model runner)", (), kind="vllm", z=2)
    box(ax, 4.5, 35.5, 15.5, 17, "paged KV cache", ("GPU or CPU", "vLLM's blocks;", "their block", "hashes are the", "pool keys"),
        kind="vllm", title_size=9.4, size=8.2, z=3)
    box(ax, 22, 46.6, 35.5, 6.3, "MaruKVConnector, scheduler side", (
        "get_num_new_matched_tokens: one lookup per request",
        "plans loads and stores; SchedulerLoadGuard seals them",
    ), kind="maru", title_size=9.4, size=8.0, z=3)
    box(ax, 22, 35.5, 35.5, 9.9, "MaruKVConnector, worker side", (
        "start_load_kv: acquire, copy pages in while verifying",
        "  each chunk's checksum, release (reply not awaited)",
        "wait_for_save: StoreWriter thread (write-behind)",
        "  reserves, copies pages out, commits",
    ), kind="maru", title_size=9.4, size=8.0, z=3)

    # ---- worker B ---------------------------------------------------------------------------------
    box(ax, 64, 55, 30, 18, "Worker B  (same shape as A)", (
        "its KvEventRelay follows the same",
        "pool subject, so it announces the",
        "chunks A stored: the router credits",
        "B with them at the host tier, and B's",
        "connector loads them from the pool",
        "instead of recomputing them",
    ), kind="panel")

    # ---- the pool: region (data plane), service (control plane) -----------------------------------
    box(ax, 1, 15, 35, 13.5, "Shared region  /dev/shm/maru-<name>  or  /dev/daxX.Y", (
        "mapped MAP_SHARED by the service and every PoolClient",
        "[region header: magic, size, UUID, incarnation]",
        "[object header 64 B: id, length, key digest, checksum |",
        " KV pages ...]; invisible until its commit",
    ), kind="region")
    box(ax, 1, 1, 35, 12, "Disaggregated prefill / decode", (
        "prefill worker stores inline, before it answers; decode",
        "worker schedules the same prompt and finds the chunks by",
        "block hash (components.dynamo_pd: empty PD params); each",
        "stands in for the other role while that role has no worker",
    ), kind="panel", size=8.2)
    box(ax, 40, 1, 58, 27.5, "Pool service   maru-dynamo pool serve   (one per host)", (
        "python -m maru_dynamo.components.pool in graphs and the Kubernetes DaemonSet",
        "metadata only, never payload bytes:",
        "  index: objects, LRU, pins, leases, part keys; allocator: page runs + slabs",
        "  per-session quotas, connection cap, metadata budget",
        "control socket: unix (tcp + token for hosts sharing CXL memory); ops:",
        "  lookup_prefix, lookup_parts, reserve, commit, abort, acquire, acquire_parts,",
        "  release, stats, snapshot, remove",
        "creates and sizes the region; checks each object's header at commit",
        "publishes stored / removed with the committer's ChunkMeta",
        "  (block hashes, parent hash, each block's tokens, block size)",
    ), kind="pool")

    # ---- the request --------------------------------------------------------------------------------
    arrow(ax, (12.2, 91), (16.8, 91), REQUEST, step="1", label="request", label_dy=2.8)
    arrow(ax, (19, 79.8), (12, 73.8), REQUEST, step="3", label="to worker A", label_at=0.22, label_dx=1.8,
          ha="left")
    arrow(ax, (10, 58.8), (10, 55.8), REQUEST)
    ax.text(11, 57.3, "engine request", fontsize=8.2, color=REQUEST["color"], va="center", zorder=9)
    arrow(ax, (4.5, 73.8), (4.5, 83.8), REQUEST, step="9", label="tokens, via\nthe frontend", label_at=0.5,
          label_dx=1.2, ha="left")

    # ---- pool calls: control plane to the service, data plane through the region ------------------
    arrow(ax, (57.8, 49.5), (62.5, 28.8), CONTROL, step="4", label="lookup_prefix,\nlookup_parts", ha="left",
          label_at=0.75, label_dx=0.6)
    arrow(ax, (41, 35.2), (41, 28.8), CONTROL, step="5", label="acquire / release", ha="left",
          label_at=0.55, both=True)
    arrow(ax, (52, 35.2), (52, 28.8), CONTROL, step="6", label="reserve, commit", ha="left", label_at=0.55)
    arrow(ax, (7, 28.8), (7, 35.2), DATA, step="5", label="pages in", ha="left", label_at=0.35)
    arrow(ax, (17, 35.2), (17, 28.8), DATA, step="6", label="pages out", ha="left", label_at=0.65)

    # ---- events back to the router ---------------------------------------------------------------
    arrow(ax, (96.5, 28.8), (96.5, 79.8), EVENTS, step="7", label="stored /\nremoved", label_at=0.7, label_dy=0.0)
    arrow(ax, (64, 79.8), (56, 73.8), EVENTS, step="8", label="pool events", label_at=0.5, label_dx=5.5,
          label_dy=0.8)
    arrow(ax, (79, 79.8), (79, 73.3), EVENTS, label="pool events", label_dx=5)
    arrow(ax, (49, 55.8), (49, 58.8), EVENTS)
    ax.text(50, 57.3, "vLLM KV events (ZMQ)", fontsize=8.2, color=EVENTS["color"], va="center", zorder=9)
    arrow(ax, (38.8, 66), (37.2, 66), EVENTS)
    arrow(ax, (28, 73.8), (28, 79.8), EVENTS, label="KV events (NATS event plane)", label_at=0.8, label_dx=1.0,
          ha="left")

    # ---- legend -----------------------------------------------------------------------------------
    legend = [
        ("request, response (HTTP, Dynamo request plane)", REQUEST),
        ("pool control plane: socket, small msgpack frames", CONTROL),
        ("data plane: KV pages through the shared mapping", DATA),
        ("events: NATS between processes, ZMQ inside a worker", EVENTS),
    ]
    for i, (text, style) in enumerate(legend):
        y = 51.5 - i * 2.6
        ax.plot([68, 72.5], [y, y], color=style["color"], lw=style["lw"], ls=style["ls"])
        ax.text(73.3, y, text, va="center", fontsize=8.4)
    ax.text(68, 41.5, "Circled numbers: the order of one request (docs/design.md).\n"
            "Regenerate: .venv/bin/python docs/design_diagram.py", fontsize=8.0, va="top", color="#455a64")

    fig.savefig(out, dpi=110, bbox_inches="tight", facecolor="white")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"PNG to write (default {DEFAULT_OUT})")
    args = parser.parse_args()
    draw(args.out)
    print(args.out)


if __name__ == "__main__":
    main()
