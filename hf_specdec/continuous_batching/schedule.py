"""Per-request draft lengths in continuous batching.

Each request keeps its own k, updated after each of its verifies from what that verify kept:

- `"constant"`: k every step (fewer only where `max_new_tokens` or the positions left cap it);
- `"heuristic"`: HF's rule, +2 after a step whose drafts were all accepted, else -1, within 1..K;
- `"adaptive"` (the default): k from the request's own acceptance. Each verify tells how many drafts were
  accepted before the first rejection, so each draft is a trial with the per-token acceptance α: α̂ = accepted /
  (accepted + rejections), over decayed counts (`DECAY`, from an optimistic prior: a new request drafts K). The
  j-th draft is kept with probability α^j, so k is the largest with α̂^k >= `WORTH` (at most K), and 0 when even
  one draft is not worth it: α 0.8 drafts 4 and more, α 0.5 drafts 2, α 0.2 stops. HF's +2/-1 rule (which this
  mode used before) averaged about 2 drafts at α 0.8 and k ≤ 4, and ran at 0.67x the throughput of k = 4 at 16
  requests on an H100 (docs/benchmarks.md).

  A request that stopped (k = 0) probes with one draft to notice when drafting pays again: `PROBE_EVERY` steps
  after it stopped, each failed probe doubling the wait up to `MAX_PROBE_EVERY`, and only on steps of the loop's
  clock that are multiples of the wait, so the requests that probe share one draft forward. Probes that each
  request timed alone made a draft forward almost every step at 16 requests: a useless draft ran at 0.85x plain CB
  on an H100.

The adaptive schedule of `generate` (hf_specdec.adaptive) prices whole-batch steps measured on a fixed batch; a
continuous batch changes every step, so it is not used here.
"""

from __future__ import annotations

#: Steps a request spends at k = 0 before its first one-draft probe (and the probes' alignment on the loop's clock).
PROBE_EVERY = 8
#: The longest wait between probes, reached by doubling the wait after each failed probe.
MAX_PROBE_EVERY = 64
#: The least probability of acceptance that makes a draft worth its share of a draft forward and a wider verify.
WORTH = 0.25
#: Weight of the past in the acceptance counts, per verify (about the last ten verifies count).
DECAY = 0.9
#: The most trials a stopped request's counts keep (its estimate stays, with little weight).
STOPPED_TRIALS = 2.0
#: The prior counts (accepted, trials) of a new request: α̂ 0.8 over four trials, so it drafts K at first.
PRIOR = (3.2, 4.0)
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
        self._counts: dict[str, tuple[float, float]] = {}  # decayed (accepted, trials) per request (adaptive)
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
        if self.mode == "adaptive":
            self._record_acceptance(request_id, k, drafted, accepted)
            return
        # HF's rule (heuristic): within 1..K, so never a probe
        self._k[request_id] = min(self.k_max, k + 2) if accepted == drafted else max(self.floor, k - 1)

    def _record_acceptance(self, request_id: str, k: int, drafted: int, accepted: int) -> None:
        kept, trials = self._counts.get(request_id, PRIOR)
        kept = DECAY * kept + accepted
        trials = DECAY * trials + accepted + (accepted < drafted)  # each accepted draft, and the rejected one
        alpha = kept / trials
        worth = self.k_max
        if alpha < 1.0:
            worth = 0
            while worth < self.k_max and alpha ** (worth + 1) >= WORTH:
                worth += 1
        self._k[request_id] = worth
        if worth > 0:
            self._counts[request_id] = (kept, trials)
            self._wait.pop(request_id, None)
            return
        # Stopped: its history weighs little (one kept probe resumes it), and it probes after a wait that doubles
        # with each failed probe, on a multiple of that wait (requests at the same wait share the probe's forward)
        scale = min(1.0, STOPPED_TRIALS / trials)
        self._counts[request_id] = (kept * scale, trials * scale)
        wait = self._wait.get(request_id, PROBE_EVERY)
        if k == 0:
            wait = self._wait[request_id] = min(MAX_PROBE_EVERY, 2 * wait)
        self._next_probe[request_id] = -(-(self._clock + wait) // wait) * wait

    def forget(self, request_id: str) -> None:
        for table in (self._k, self._wait, self._next_probe, self._counts):
            table.pop(request_id, None)

    def clear(self) -> None:
        for table in (self._k, self._wait, self._next_probe, self._counts):
            table.clear()
        self._clock = 0

    def k_of(self, request_id: str) -> int:
        return self.k_max if self.mode == "constant" else self._k.get(request_id, self.k_max)
