"""Per-request draft lengths in continuous batching.

Each request keeps its own k, updated after each of its verifies from what that verify kept:

- `"constant"`: k every step (fewer only where `max_new_tokens` or the positions left cap it);
- `"heuristic"`: HF's rule, +2 after a step whose drafts were all accepted, else -1, within 1..K;
- `"adaptive"` (the default): the same rule within 0..K, so that a request whose drafts keep failing stops
  drafting (a useless draft then costs almost nothing). At k = 0 it probes with one draft to notice when drafting
  pays again: `PROBE_EVERY` steps after it stopped, each failed probe doubling the wait up to `MAX_PROBE_EVERY`,
  and only on steps of the loop's clock that are multiples of `PROBE_EVERY`, so the requests that probe share one
  draft forward. Probes that each request timed alone made a draft forward almost every step at 16 requests: a
  useless draft ran at 0.85x plain CB on an H100.

The adaptive schedule of `generate` (hf_specdec.adaptive) prices whole-batch steps measured on a fixed batch; a
continuous batch changes every step, so it is not used here.
"""

from __future__ import annotations

#: Steps a request spends at k = 0 before its first one-draft probe (and the probes' alignment on the loop's clock).
PROBE_EVERY = 8
#: The longest wait between probes, reached by doubling the wait after each failed probe.
MAX_PROBE_EVERY = 64
SCHEDULE_MODES = ("constant", "heuristic", "adaptive")


class RequestSchedule:
    """k per request id, for one continuous-batching loop."""

    def __init__(self, mode: str, k_max: int) -> None:
        if mode == "heuristic_transient":
            mode = "heuristic"  # no k carried across calls in CB: both restart from k_max per request
        if mode not in SCHEDULE_MODES:
            raise ValueError(f"Unknown draft schedule {mode!r} for continuous batching: one of {SCHEDULE_MODES}.")
        self.mode, self.k_max = mode, k_max
        self.floor = 0 if mode == "adaptive" else 1
        self._k: dict[str, int] = {}
        self._wait: dict[str, int] = {}  # steps between probes at k = 0 (adaptive)
        self._next_probe: dict[str, int] = {}  # the clock's step of the next probe, for requests at k = 0
        self._clock = 0  # loop steps so far

    def tick(self) -> None:
        """One step of the loop begins (called once per step, before any budget of that step)."""
        self._clock += 1

    def budget(self, request_id: str) -> int:
        """The most drafts the request may get this step."""
        if self.mode == "constant":
            return self.k_max
        k = self._k.setdefault(request_id, self.k_max)
        if k > 0:
            return k
        return 1 if self._clock >= self._next_probe.get(request_id, 0) else 0

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """After a verify of the request: `drafted` drafts were verified, `accepted` kept."""
        if self.mode == "constant" or drafted == 0:
            return
        k = self._k.get(request_id, self.k_max)
        if accepted == drafted:
            self._k[request_id] = min(self.k_max, k + 2)
            self._wait.pop(request_id, None)
            return
        if k == 0:  # a failed probe: wait twice as long for the next one
            self._wait[request_id] = min(MAX_PROBE_EVERY, 2 * self._wait.get(request_id, PROBE_EVERY))
        else:
            self._k[request_id] = max(self.floor, k - 1)
        if self._k[request_id] == 0:  # the next probe: after the wait, on a step of the shared alignment
            due = self._clock + self._wait.get(request_id, PROBE_EVERY)
            self._next_probe[request_id] = -(-due // PROBE_EVERY) * PROBE_EVERY

    def forget(self, request_id: str) -> None:
        for table in (self._k, self._wait, self._next_probe):
            table.pop(request_id, None)

    def clear(self) -> None:
        for table in (self._k, self._wait, self._next_probe):
            table.clear()
        self._clock = 0

    def k_of(self, request_id: str) -> int:
        return self.k_max if self.mode == "constant" else self._k.get(request_id, self.k_max)
