"""Timelines: phase spans as JSONL, as a Chrome trace (opens in Perfetto), and as a Gantt PNG.

Sim and real runs write the same schema, which is how the two are compared. A recorded run's
spans.jsonl may be kept compressed as spans.jsonl.gz (old sessions' runs, so that the tree a GPU call
carries stays small): every reader goes through ``stored`` / ``read_bytes`` / ``read_text``.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from nodus.messages import Span


def write_jsonl(runs: list[list[Span]], path: Path) -> None:
    """One span per line; `gpu` tells the run (dedicated arms have one GPU per job)."""
    with open(path, "w") as f:
        for gpu, spans in enumerate(runs):
            for s in spans:
                f.write(json.dumps({**s.to_dict(), "gpu": gpu}, sort_keys=True) + "\n")


def stored(path: str | Path) -> Path:
    """``path``, or ``path`` + ``.gz`` where only the compressed copy is kept."""
    p = Path(path)
    if not p.exists():
        gz = p.with_name(p.name + ".gz")
        if gz.exists():
            return gz
    return p


def read_bytes(path: str | Path) -> bytes:
    """A file's bytes, decompressed where only ``path.gz`` is kept: the same bytes either way."""
    p = stored(path)
    return gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()


def read_text(path: str | Path) -> str:
    return read_bytes(path).decode()


def read_jsonl(path: Path) -> list[list[Span]]:
    runs: dict[int, list[Span]] = {}
    for n, line in enumerate(read_text(path).splitlines(), 1):
        try:
            d = json.loads(line)
            runs.setdefault(d.get("gpu", 0), []).append(Span.from_dict(d))
        except (json.JSONDecodeError, KeyError) as err:
            raise ValueError(f"{path}:{n}: not a span line ({err})") from None
    return [runs[k] for k in sorted(runs)]


def _lane(s: Span) -> str:
    return "engine" if s.phase == "generate" else "trainer"


def chrome_trace(runs: list[list[Span]]) -> dict:
    """Trace Event Format: one process per GPU, one thread per (stack, group, lane)."""
    events, tids = [], {}
    for gpu, spans in enumerate(runs):
        events.append({"ph": "M", "name": "process_name", "pid": gpu, "tid": 0, "args": {"name": f"GPU {gpu}"}})
        for s in sorted(spans, key=lambda s: (s.start_s, s.job, s.phase)):
            key = (gpu, s.stack, s.group, _lane(s))
            if key not in tids:
                tids[key] = len(tids) + 1
                events.append({"ph": "M", "name": "thread_name", "pid": gpu, "tid": tids[key],
                               "args": {"name": f"stack {s.stack} group {s.group} {_lane(s)}"}})
            events.append({"ph": "X", "name": f"{s.phase} {s.job}", "cat": s.phase, "pid": gpu,
                           "tid": tids[key], "ts": s.start_s * 1e6, "dur": (s.end_s - s.start_s) * 1e6,
                           "args": {"job": s.job, "group": s.group, **{k: v for k, v in s.attrs.items()
                                                                        if k != "response_tokens"}}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome_trace(runs: list[list[Span]], path: Path) -> None:
    path.write_text(json.dumps(chrome_trace(runs)))


COLORS = {"generate": "#4C72B0", "train": "#DD8452", "publish": "#55A868"}


def plot_gantt(spans: list[Span], path: Path, title: str = "", max_s: float | None = None) -> None:
    """Engine and trainer rows per group; a group's phases are merged over its jobs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows: dict[tuple, list[tuple[float, float, str]]] = {}
    for s in spans:
        if max_s is not None and s.start_s > max_s:
            continue
        lane = "engine" if s.phase == "generate" else "trainer"
        rows.setdefault((s.stack, s.group, lane), []).append((s.start_s, s.end_s, s.phase))
    keys = sorted(rows)
    fig, ax = plt.subplots(figsize=(12, 0.45 * len(keys) + 1.5))
    for y, key in enumerate(keys):
        seen = set()
        for a, b, phase in sorted(rows[key]):
            if (a, b, phase) in seen:
                continue
            seen.add((a, b, phase))
            ax.barh(y, b - a, left=a, height=0.7, color=COLORS[phase], edgecolor="none")
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"stack {k[0]} group {k[1]} {k[2]}" if k[0] else f"group {k[1]} {k[2]}" for k in keys])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    if max_s is not None:
        ax.set_xlim(0, max_s)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), loc="upper right", ncol=3, fontsize=8)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_learning_curves(per_job: dict, path: Path, title: str = "") -> bool:
    """Mean training reward per step for each job (final eval accuracy in the legend); False when
    the run recorded no rewards (the simulator)."""
    curves = {j: d.get("rewards") or [] for j, d in per_job.items()}
    if not any(curves.values()):
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for job, rewards in sorted(curves.items()):
        d = per_job[job]
        acc = d.get("eval", {}).get("accuracy")
        label = f"{job} ({d.get('task', '?')})" + (f", eval {acc:.2f}" if acc is not None else "")
        ax.plot(range(len(rewards)), rewards, marker="o", ms=3, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean training reward")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
