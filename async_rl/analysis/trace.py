"""Pictures of a run: a Chrome-trace JSON for Perfetto and a timeline PNG.

Owns: the trace event layout (one track per worker, the controller's tracks, version
markers, weight-broadcast flow arrows, counter tracks of per-step figures, a note of
which workers were left out; after them, one process per rollout engine holding its
agent sessions, a track each: the session, and inside it its turns and the agent's
stretches between them) and the
matplotlib timeline (one row per device, coloured by cause; for a large run, one row per
role above them, each time bin split by the share of the role's devices in each cause).
Knows nothing about how spans were recorded or resolved, or which workers to draw.
"""

from __future__ import annotations

import math
import textwrap
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from async_rl.analysis.idle import ROLE_ORDER, natural_key
from workers.common.spans import WEIGHT_UPDATE, SessionSpan, Span

# One colour per cause, busy causes in greens/blues, idle causes in warm colours, so the
# picture reads "green good, red/orange waiting" without a legend lookup.
COLOURS = {
    "generate": "#2e7d32",
    "evaluate": "#66bb6a",
    "forward": "#1565c0",
    "backward": "#1e88e5",
    "optimizer": "#64b5f6",
    "weight_sync": "#8e24aa",
    "weight_wire": "#6a1b9a",
    "weight_load": "#ce93d8",
    "weight_publish": "#ab47bc",
    "checkpoint": "#6d4c41",
    "gate_closed": "#e53935",
    "queue_full": "#fb8c00",
    "wait_data": "#f4511e",
    "barrier": "#fdd835",
    "no_work": "#bdbdbd",
    "idle": "#9e9e9e",
    "training": "#90caf9",
    "admitting": "#a5d6a7",
}


TIMELINE_WIDTH_IN = 12
FOOTER_CHARS = 150
"""Characters of the 9-point footer that fit across the timeline's 12 inches (DejaVu
Sans averages about 0.55 em a character: 12 * 72 / (9 * 0.55) = 174, less margins)."""
FOOTER_LINE_IN = 0.19
"""Height of one footer line: 9 points at 1.2 line spacing, in inches, rounded up."""


def _order(spans: Sequence[Span]) -> list[str]:
    """Track order: the roles' workers (rollout, trainer, critic, reference), then
    controller tracks."""
    rank = {role: i for i, role in enumerate(ROLE_ORDER)}
    names = {s.worker: (rank.get(s.role, len(rank)), s.rank, s.worker) for s in spans}
    return sorted(names, key=lambda n: names[n])


class _Complete(msgspec.Struct, frozen=True, kw_only=True):
    """One span as a trace event ("X": a complete event)."""

    ph: str = "X"
    name: str
    cat: str
    pid: int = 1
    tid: int
    ts: float
    dur: float
    args: dict[str, int | str]


def _us(t: float, origin: float, digits: int | None = 1) -> float:
    """A time as the trace's: microseconds since ``origin``, to ``digits`` places (None:
    whole ones)."""
    return round((t - origin) * 1e6, digits)


def _track(pid: int, tid: int, name: str, sort: int) -> list[dict[str, Any]]:
    """The metadata of a track: its name and place within its process."""
    return [{"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
             "args": {"name": name}},
            {"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
             "args": {"sort_index": sort}}]


def _process(pid: int, name: str) -> list[dict[str, Any]]:
    """The metadata of a process: its name, and its place (in pid order)."""
    return [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
            {"ph": "M", "name": "process_sort_index", "pid": pid,
             "args": {"sort_index": pid}}]


def session_events(sessions: Sequence[SessionSpan], origin: float, first_tid: int
                   ) -> list[dict[str, Any] | _Complete]:
    """The agent sessions' events: a process per rollout engine (pids from 2, in the
    engines' order), a track per session in the order opened (tids from ``first_tid``)
    with a slice over the whole session named by how it ended ("session done",
    "session timeout", "session error") and, inside it, each turn ("turn 0", "turn
    1", ...: its tokens, versions, segment) and each of the agent's own stretches
    ("agent"). In whole microseconds, so that each slice ends inside its session's
    exactly as the viewer reads them."""
    by_worker: dict[str, list[SessionSpan]] = defaultdict(list)
    for session in sessions:
        by_worker[session.worker].append(session)
    events: list[dict[str, Any] | _Complete] = []
    tid = first_tid
    for pid, worker in enumerate(sorted(by_worker, key=natural_key), 2):
        events += _process(pid, f"{worker}: agent sessions")
        for session in sorted(by_worker[worker], key=lambda s: s.session):
            kind = "eval session" if session.greedy else "session"
            ended = f" ({session.outcome})" if session.outcome != "done" else ""
            events += _track(pid, tid, f"{kind} {session.session}{ended}", session.session)
            start = _us(session.opened, origin, None)
            events.append(_Complete(
                name=f"session {session.outcome}", cat="session", pid=pid, tid=tid,
                ts=start, dur=_us(session.closed, origin, None) - start,
                args={"prompt_id": session.prompt_id, "member": session.member,
                      "turns": len(session.turns), "refused": session.refused}))
            for begin, end, turn in session.stretches():
                start = _us(begin, origin, None)
                events.append(_Complete(
                    name="agent" if turn is None else f"turn {turn.turn}",
                    cat="agent" if turn is None else "turn", pid=pid, tid=tid, ts=start,
                    dur=_us(end, origin, None) - start, args={} if turn is None else {
                        "segment": turn.segment, "prompt_tokens": turn.prompt_tokens,
                        "new_prompt_tokens": turn.new_prompt_tokens,
                        "completion_tokens": turn.completion_tokens,
                        "min_version": turn.min_version, "max_version": turn.max_version,
                        "finish_reason": turn.finish_reason}))
            tid += 1
    return events


ROLE_BINS = 600
"""Time bins of a role's row in the timeline (about one per pixel column of the axes)."""


class Counter(msgspec.Struct, frozen=True, kw_only=True):
    """One value change of a counter track (e.g. a step's staleness from its start)."""

    track: str
    at: float
    """Seconds since the epoch, as spans' times."""
    values: dict[str, float]
    """One series of the track per key."""


def chrome_trace(spans: Sequence[Span], note: str = "",
                 counters: Sequence[Counter] = (),
                 sessions: Sequence[SessionSpan] = ()) -> dict[str, Any]:
    """Trace-event JSON (open at ui.perfetto.dev): tracks, markers, broadcast flows,
    ``counters``, then the agent ``sessions`` (``session_events``); ``note`` (which
    workers were left out) is the run's process's name and the trace's metadata."""
    if not spans:
        return {"traceEvents": [], "displayTimeUnit": "ms"}
    origin = min(s.start for s in spans)
    tids = {name: i + 1 for i, name in enumerate(_order(spans))}
    events: list[dict[str, Any] | _Complete] = [
        *_process(1, f"async-rl run ({note})" if note else "async-rl run")]
    devices = {s.worker: s.device for s in spans}
    for name, tid in tids.items():
        events += _track(1, tid, f"{name} ({devices[name]})", tid)

    # The hot loop of a large run's trace (a million spans): _us() inlined, and a
    # Struct a span (quicker to make and to encode than a dict).
    for s in spans:
        start = round((s.start - origin) * 1e6, 1)
        events.append(_Complete(name=s.cause, cat=s.role, tid=tids[s.worker], ts=start,
                                dur=round((s.end - origin) * 1e6, 1) - start,
                                args={"version": s.version}))
    publishes = {s.version: s for s in spans if s.cause == "weight_publish"}
    # An arrow from each publish to where each engine's pause for it began.
    firsts: dict[tuple[int, str], Span] = {}
    for s in sorted(spans, key=lambda s: s.start):
        if s.cause in WEIGHT_UPDATE:
            firsts.setdefault((s.version, s.worker), s)
    syncs: dict[int, list[Span]] = defaultdict(list)
    for (version, _), s in firsts.items():
        syncs[version].append(s)
    for version, publish in sorted(publishes.items()):
        events.append({"ph": "i", "s": "g", "name": f"v{version}", "pid": 1,
                       "tid": tids[publish.worker], "ts": _us(publish.end, origin)})
        for sync in syncs[version]:
            flow = {"name": f"weights v{version}", "cat": "broadcast", "pid": 1,
                    "id": version * 1000 + sync.rank}
            events.append({**flow, "ph": "s", "tid": tids[publish.worker],
                           "ts": _us(publish.start, origin)})
            events.append({**flow, "ph": "f", "bp": "e", "tid": tids[sync.worker],
                           "ts": _us(sync.start, origin)})
    events.extend({"ph": "C", "name": c.track, "pid": 1, "ts": _us(c.at, origin),
                   "args": c.values} for c in counters)
    events += session_events(sessions, origin, len(tids) + 1)
    return {"traceEvents": events, "displayTimeUnit": "ms",
            **({"metadata": {"workers": note}} if note else {})}


def write_chrome_trace(spans: Sequence[Span], path: str | Path, note: str = "",
                       counters: Sequence[Counter] = (),
                       sessions: Sequence[SessionSpan] = ()) -> None:
    Path(path).write_bytes(msgspec.json.encode(chrome_trace(spans, note, counters,
                                                            sessions)))


def cause_shares(spans: Sequence[Span], devices: int, edges: np.ndarray
                 ) -> dict[str, np.ndarray]:
    """Per cause, the share of ``devices`` devices' time in it in each bin between
    ``edges``: the time covered by a cause's spans up to t is the sum over spans started
    before t of (t - start), less that over spans ended before t, so sorted starts and
    ends give every bin at once."""
    by_cause: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for s in spans:
        starts, ends = by_cause[s.cause]
        starts.append(s.start)
        ends.append(s.end)
    shares = {}
    width = np.diff(edges) * max(devices, 1)
    for cause, bounds in by_cause.items():
        covered = np.zeros_like(edges)
        for times_, sign in zip(bounds, (1.0, -1.0), strict=True):
            times = np.sort(np.array(times_))
            before = np.searchsorted(times, edges)
            sums = np.concatenate(([0.0], np.cumsum(times)))
            covered += sign * (before * edges - sums[before])
        shares[cause] = np.diff(covered) / width
    return shares


def write_timeline_png(spans: Sequence[Span], path: str | Path, title: str = "",
                       row_notes: dict[str, str] | None = None, footer: str = "",
                       roles: dict[str, tuple[Sequence[Span], int]] | None = None) -> None:
    """One row per worker, coloured by cause, with a legend of the causes present.

    ``row_notes`` adds a line under a row's label (e.g. "busy 48%, waits: wait_data");
    ``footer`` is printed under the legend (e.g. the top idle cause and its hint), each
    of its lines wrapped to the image's width. ``roles`` (role: its spans and its
    number of devices) adds a row per role on top, each time bin stacked by the share
    of the role's devices in each cause (``cause_shares``).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    roles = roles or {}
    names = _order(spans)
    everything = [s for spans_, _ in roles.values() for s in spans_] + list(spans)
    origin = min((s.start for s in everything), default=0.0)
    devices = {s.worker: s.device for s in spans}
    known = list(COLOURS)
    present = sorted({s.cause for s in everything},
                     key=lambda c: known.index(c) if c in known else len(known))
    columns = min(len(present), 7) or 1
    footer_lines = [wrapped for line in footer.splitlines()
                    for wrapped in textwrap.wrap(line, FOOTER_CHARS)]
    footer_s = FOOTER_LINE_IN * len(footer_lines) + (0.1 if footer_lines else 0.0)
    # Legend and footer sit in a strip of their own under the axes, sized in inches so
    # the x-axis label never runs into them whatever the number of rows.
    strip = 0.25 * math.ceil(len(present) / columns) + footer_s
    height = 1.4 + 0.55 * (len(names) + len(roles)) + strip
    fig, ax = plt.subplots(figsize=(TIMELINE_WIDTH_IN, height))
    by_worker: dict[str, list[Span]] = defaultdict(list)
    for s in spans:
        by_worker[s.worker].append(s)
    for row, name in enumerate(reversed(names)):
        mine = by_worker[name]
        ax.broken_barh(
            [(s.start - origin, s.end - s.start) for s in mine], (row - 0.4, 0.8),
            facecolors=[COLOURS.get(s.cause, "#000000") for s in mine], linewidth=0,
        )
    end = max((s.end for s in everything), default=origin)
    edges = np.linspace(origin, max(end, origin + 1e-9), ROLE_BINS + 1)
    for row, (role_spans, count) in enumerate(reversed(roles.values()), len(names)):
        bottom = np.zeros(ROLE_BINS)
        for cause, share in sorted(cause_shares(role_spans, count, edges).items(),
                                   key=lambda item: present.index(item[0])):
            top = bottom + share
            ax.fill_between(edges - origin, row - 0.4 + 0.8 * np.append(bottom, bottom[-1]),
                            row - 0.4 + 0.8 * np.append(top, top[-1]), step="post",
                            color=COLOURS.get(cause, "#000000"), linewidth=0)
            bottom = top
    ax.set_yticks(range(len(names) + len(roles)))
    notes = row_notes or {}
    ax.set_yticklabels([f"{n} ({devices[n]})" + (f"\n{notes[n]}" if n in notes else "")
                        for n in reversed(names)]
                       + [f"{role}: {count} devices\n(share in each cause)"
                          for role, (_, count) in reversed(roles.items())], fontsize=8)
    ax.set_xlabel("seconds since start")
    fig.legend(handles=[Patch(color=COLOURS.get(c, "#000000"), label=c) for c in present],
               loc="lower center", bbox_to_anchor=(0.5, (footer_s or 0.05) / height),
               ncol=columns, fontsize=8, frameon=False)
    ax.set_title(title or "what each device did (green/blue busy, warm colours waiting)")
    if footer_lines:
        fig.text(0.01, 0.05 / height, "\n".join(footer_lines), fontsize=9, ha="left",
                 va="bottom", linespacing=1.2)
    fig.tight_layout(rect=(0, (strip + 0.1) / height, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
