"""Per-request draft lengths in continuous batching.

Each request keeps its own k, updated after each of its verifies from what that verify kept:

- `"constant"`: k every step (fewer only where `max_new_tokens` or the positions left cap it);
- `"heuristic"`: HF's rule, +2 after a step whose drafts were all accepted, else -1, within 1..K;
- `"adaptive"` (the default): the same rule within 0..K, so that a request whose drafts keep failing stops
  drafting (a useless draft then costs almost nothing), with a one-draft probe every `PROBE_EVERY` steps at k = 0
  to notice when drafting pays again.

The adaptive schedule of `generate` (hf_specdec.adaptive) prices whole-batch steps measured on a fixed batch; a
continuous batch changes every step, so it is not used here.
"""

from __future__ import annotations

#: Steps a request spends at k = 0 before a one-draft probe.
PROBE_EVERY = 8
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
        self._idle: dict[str, int] = {}  # steps spent at k = 0

    def budget(self, request_id: str) -> int:
        """The most drafts the request may get this step."""
        if self.mode == "constant":
            return self.k_max
        k = self._k.setdefault(request_id, self.k_max)
        if k == 0 and self._idle.get(request_id, 0) >= PROBE_EVERY:
            return 1
        return k

    def record(self, request_id: str, drafted: int, accepted: int) -> None:
        """After a verify of the request: `drafted` drafts were verified, `accepted` kept."""
        if self.mode == "constant":
            return
        k = self._k.get(request_id, self.k_max)
        if drafted == 0:
            if k == 0:
                self._idle[request_id] = self._idle.get(request_id, 0) + 1
            return
        self._idle.pop(request_id, None)
        self._k[request_id] = min(self.k_max, k + 2) if accepted == drafted else max(self.floor, k - 1)

    def forget(self, request_id: str) -> None:
        self._k.pop(request_id, None)
        self._idle.pop(request_id, None)

    def clear(self) -> None:
        self._k.clear()
        self._idle.clear()

    def k_of(self, request_id: str) -> int:
        return self.k_max if self.mode == "constant" else self._k.get(request_id, self.k_max)
