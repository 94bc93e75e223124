"""The idle table as the console shows it, bounded whatever the number of devices.

Owns: which workers a table or a picture lists one by one (every one up to
``DEVICE_ROWS``; past it, the ``FEW_DEVICES`` most idle of each role, in natural order: rollout-2
before rollout-10), the idle table itself (per-role rows first, then those workers),
percentages as the tables print them, and the console they print on. Knows nothing about
where the accounting comes from.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from async_rl.analysis.idle import ROLE_ORDER, Breakdown, natural_key
from workers.common.spans import IDLE

DEVICE_ROWS = 16
"""Up to this many workers, tables and the timeline list every one."""
FEW_DEVICES = 4
"""Past DEVICE_ROWS, the most idle workers of each role listed after the role rows."""


def wide_console() -> Console:
    """Wide enough for every cause column even when output goes to a file or a pipe."""
    console = Console()
    return console if console.is_terminal else Console(width=160)


def pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


def most_idle(workers: Sequence[Breakdown], few: int) -> list[Breakdown]:
    """Of each role, the ``few`` workers idle for the largest share of their time (to
    0.1%; ties: the first in natural order), listed in natural order."""
    picked: list[Breakdown] = []
    for role in dict.fromkeys(w.role for w in workers):
        mine = [w for w in workers if w.role == role]
        picked += sorted(mine, key=lambda w: (-round(w.idle_fraction, 3),
                                              natural_key(w.name)))[:few]
    return sorted(picked, key=lambda w: natural_key(w.name))


def listed_workers(workers: Sequence[Breakdown], every: bool = False) -> list[Breakdown]:
    """The workers a table lists one by one: all of them up to ``DEVICE_ROWS`` (or with
    ``every``), else the ``FEW_DEVICES`` most idle of each role."""
    if every or len(workers) <= DEVICE_ROWS:
        return sorted(workers, key=lambda w: natural_key(w.name))
    return most_idle(workers, FEW_DEVICES)


def idle_table(workers: Sequence[Breakdown], roles: Sequence[Breakdown], title: str, *,
               every: bool = False) -> Table:
    """Per-role rows, then the workers ``listed_workers`` picks; a caption says how many
    were left out."""
    causes = list(dict.fromkeys(c for role in ROLE_ORDER
                                for c in IDLE[role]))
    listed = listed_workers(workers, every)
    left = len(workers) - len(listed)
    table = Table(title=title, caption=(
        f"the {len(listed)} most idle of {len(workers)} workers; idle.json has every one "
        "(async-rl report --all lists them)") if left else None)
    names = max((len(item.name) for item in (*roles, *listed)), default=0)
    for column in ("worker", "device", "busy", "idle", *causes):
        # A row a line: names keep their width; a role's "N device(s)" is truncated
        # rather than wrapped onto a second line.
        table.add_column(column,
                         justify="right" if column not in ("worker", "device") else "left",
                         no_wrap=column == "device",
                         min_width=names if column == "worker" else None)
    for item in (*roles, *listed):
        table.add_row(
            item.name, item.device, pct(item.busy_s, item.wall_s),
            pct(item.idle_s, item.wall_s),
            *(pct(item.idle_by_cause[c], item.wall_s) if c in item.idle_by_cause else ""
              for c in causes),
            style="bold" if item.name == item.role else None,
            end_section=item is roles[-1],
        )
    return table
