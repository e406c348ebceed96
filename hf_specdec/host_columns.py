"""`HostColumns`: the host's copy of what a `CacheView` holds per row, so that its forwards and rollbacks on a dynamic
cache need no host read.

A dynamic forward's width is the most tokens any row feeds; a rollback crops the trailing columns that every row
left empty, and compacts when holes dominate. All three follow from two numbers per row that the host can keep
itself when it knows what each forward fed and what each rollback keeps (the loop learns both from its one read per
step): the row's cached length (the cache holds buffer indices `[0, cached[i])`), and the column of its newest real
entry. A row's real columns hold its buffer indices in increasing order (appended in order; compaction is stable),
so after a rollback into the latest forward that column is found from where that forward started writing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class HostColumns:
    """Per row: cached length and newest real column, on the host (numpy int64 [B])."""

    cached: np.ndarray  # [B] the cache holds buffer indices [0, cached[i]) of row i
    last: np.ndarray  # [B] column of row i's newest real entry, -1 when it has none
    pad: np.ndarray  # [B] left padding (indices below it are holes)
    #: the forwards since the latest rollback, so that a rollback into them knows their columns: each one's first
    #: column and the rows' cached lengths and newest real columns before it
    fed_log: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)

    @classmethod
    def empty(cls, pad: np.ndarray) -> HostColumns:
        return cls(cached=np.zeros_like(pad), last=np.full_like(pad, -1), pad=pad)

    def width(self) -> int:
        """Columns up to the last one any row holds a real entry in (the crop width)."""
        return int(np.max(self.last)) + 1 if len(self.last) else 0

    def real(self) -> np.ndarray:  # [B]
        """Real columns per row: every buffer index in [pad, cached) has exactly one."""
        return np.maximum(self.cached - self.pad, 0)

    def fed(self, first_column: int, num_new: np.ndarray) -> None:  # num_new: [B]
        """A forward appended columns `first_column ..`: row i's next `num_new[i]` buffer indices, the rest holes."""
        self.fed_log.append((first_column, self.cached, self.last))
        end = self.cached + num_new
        real = (num_new > 0) & (end - 1 >= self.pad)
        self.last = np.where(real, first_column + num_new - 1, self.last)
        self.cached = end

    def kept_newest(self, column: int) -> None:
        """Every row fed one real token into `column` and keeps it (a plain step): nothing to log for a rollback,
        and a rollback into what was fed before now reads the device (`rolled_back` returns None)."""
        self.cached = self.cached + 1
        self.last = np.full_like(self.last, column)
        self.fed_log = []

    def rolled_back(self, cached: np.ndarray) -> bool | None:  # cached: [B]
        """Rows keep buffer indices < cached[i]. Returns whether any row dropped an entry, or None when a row goes
        back past the forwards since the latest rollback (its columns are not known here: the caller reads them)."""
        new = np.minimum(self.cached, cached)
        dropped = new < self.cached
        log, self.fed_log = self.fed_log, []
        if not dropped.any():
            return False
        last, pending = self.last.copy(), dropped.copy()
        for first_column, cached_before, last_before in reversed(log):  # the forward that fed index new - 1
            hit = pending & (new > cached_before)
            real = new - 1 >= self.pad
            last = np.where(hit, np.where(real, first_column + new - 1 - cached_before, last_before), last)
            pending &= ~hit
        if pending.any():  # back to where the first forward started, or past it (unknown)
            if not log or (new[pending] != log[0][1][pending]).any():
                return None
            last = np.where(pending, log[0][2], last)
        self.last, self.cached = last, new
        return True

    def compacted(self, width: int) -> None:
        """Each row's real columns moved to the right end of a cache `width` wide."""
        self.last = np.where(self.real() > 0, width - 1, -1)
        self.fed_log = []

    def select(self, keep: np.ndarray) -> HostColumns:  # keep: [B'] row indices
        return HostColumns(cached=self.cached[keep], last=self.last[keep], pad=self.pad[keep])
