"""`SpecDecoder`: what to speculate with (method, draft, k, n-gram sizes, seed), validated up front.

A `SpecDecoder` is a plain `@dataclass(kw_only=True)`: validated in `__post_init__`, turned into
a dict and back with `to_dict` / `from_dict` (model objects excluded), and reused across calls.
After each `generate` call it holds that call's `SpecDecodeStats` in `last_stats`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from hf_specdec.metrics import SpecDecodeStats

METHODS = ("draft", "ngram", "mtp", "early_exit", "gemma4_assistant", "dflash", "eagle3", "suffix")
#: Methods that draft with the model passed as `draft_model` (a causal LM, a Gemma 4 assistant, a DFlash drafter).
DRAFT_MODEL_METHODS = ("draft", "gemma4_assistant", "dflash")
MAX_SPECULATIVE_TOKENS = 32
#: `num_speculative_tokens` when it is not given: suffix decoding drafts long repeated blocks (24: vLLM's default
#: there, its tree depth), the others k = 5.
DEFAULT_SPECULATIVE_TOKENS = {"suffix": 24}
#: Suffix decoding's settings and their defaults (vLLM's, plus a memory bound in tokens).
SUFFIX_DEFAULTS = {
    "suffix_max_tree_depth": 24,
    "suffix_max_cached_requests": 10_000,
    "suffix_max_cached_tokens": 100_000,
    "suffix_max_spec_factor": 1.0,
    "suffix_min_token_prob": 0.1,
}
SCHEDULES = ("constant", "heuristic", "heuristic_transient", "adaptive")


@dataclass(kw_only=True)
class SpecDecoder:
    """Configuration of speculative decoding for `model.generate`.

    Args:
        method (`str`, *optional*):
            `"draft"` (a smaller causal LM sharing the target's tokenizer), `"ngram"` (prompt lookup in
            the row's own tokens) or `"mtp"` (the target's own multi-token-prediction layers, for models whose
            config has `num_mtp_layers`) or `"early_exit"` (LayerSkip self-speculation: the target's first
            `early_exit_layers` layers and its LM head draft; HF's `assistant_early_exit`) or `"gemma4_assistant"`
            (a `Gemma4AssistantForCausalLM` as `draft_model`, reading the target's keys and values) or `"dflash"`
            (a DFlash block drafter as `draft_model`, fed the target's hidden states; HF's
            `speculation_type="dflash"`) or `"eagle3"` (an EAGLE-3 head as `draft_head`, fed the target's hidden
            states) or `"suffix"` (suffix decoding: suffix trees over each row's tokens and over earlier outputs;
            with a `draft_model`, each row takes the trees' draft or the model's, whichever is worth more). Defaults
            to `"eagle3"` when `draft_head` is given, `"gemma4_assistant"` when `draft_model` is a
            Gemma 4 assistant, `"draft"` when it is another model, `"early_exit"` when `early_exit_layers` is given,
            else `"ngram"`.
        draft_model (`PreTrainedModel`, *optional*):
            The draft model for `method="draft"`. It must have the target's vocabulary and sit on the
            target's device. For `method="gemma4_assistant"` the `Gemma4AssistantForCausalLM` (or its unified
            twin) of a Gemma 4 target; for `method="dflash"` the DFlash drafter (`MuseGlimmerAssistantModel`); for
            `method="suffix"` the draft model of the hybrid (optional).
        draft_head (`Eagle3Head`, *optional*):
            For `method="eagle3"`: an EAGLE-3 draft head from `hf_specdec.load_draft_head(path)` (the EAGLE authors'
            or the speculators layout), trained for the target. It reads the target's hidden states from the verify.
        draft_tokenizer (`PreTrainedTokenizerBase`, *optional*):
            The draft model's tokenizer when it differs from the target's (HF's `assistant_tokenizer`: universal
            assisted generation). Drafts are translated through text; the target's tokenizer must be given too
            (`tokenizer=` here, or the call's `tokenizer=` after `install()`). Greedy and sampling stay exact.
        mtp_model (`MtpModel`, *optional*):
            The MTP layers for `method="mtp"` (`transformers.modeling_layers.MtpModel`). By default they are
            loaded once from the target's checkpoint with `MtpModel.from_pretrained(target)` and reused.
        early_exit_layers (`int`, *optional*):
            For `method="early_exit"`: how many of the target's first decoder layers draft (1..num_layers - 1).
            Meant for models trained to exit early (e.g. `facebook/layerskip-llama3.2-1B`); any model is exact.
        num_speculative_tokens (`int`, defaults to 5, 24 for `method="suffix"`):
            Draft tokens per step, k, in 1..32 (the largest k with `num_speculative_tokens_schedule="adaptive"`,
            the starting k with the heuristic schedules).
        num_speculative_tokens_schedule (`str`, defaults to `"adaptive"`):
            How many drafts each row gets per step:
            - `"adaptive"` (the default): per step, the number of drafts (0..num_speculative_tokens) that maximises expected
              tokens per second, from acceptance measured per kind of draft (for prompt lookup: the matched
              n-gram length) and from step costs measured on this device (the first call on a model times a
              forward of each width once; `hf_specdec.adaptive`). Speculation switches itself off (plain
              decoding through the same loop) where it does not pay, so the default is never slower than plain
              decoding beyond noise. The first call on a model spends k + 1 forwards measuring (one more pass on
              each of the next two calls).
            - `"constant"`: k every step (fewer only near `max_length` or the draft's position limit).
            - `"heuristic"`: HF's schedule, per row: +2 after a step whose drafts were all accepted, else -1 (at
              least 1, at most 32). The final k is written back to `num_speculative_tokens` (and to the draft's
              `generation_config.num_assistant_tokens`), so it persists across calls like HF's.
            - `"heuristic_transient"`: the same, restarting from `num_speculative_tokens` every call.
        draft_confidence_threshold (`float`, *optional*):
            HF's `assistant_confidence_threshold` (methods `"draft"` and `"early_exit"`): a row stops drafting after a draft token
            whose draft probability is below it, and the threshold is re-fit after each step to the accepted /
            rejected history (HF's ROC rule). `None` or 0 turns it off.
        max_draft_len (`int`, *optional*):
            Rows whose length (prompt + generated, padding excluded) plus drafts would reach this stop speculating
            and decode one token per step. A draft model's own `max_position_embeddings` always applies too.
        prompt_lookup_min (`int`, defaults to 1), prompt_lookup_max (`int`, defaults to 4):
            The n-gram sizes searched by `method="ngram"`, longest first.
        suffix_max_tree_depth (`int`, defaults to 24):
            `method="suffix"`: the longest string (in tokens) the suffix trees count; a draft is matched on at most
            this many of the row's last tokens, and past that depth later drafts are predicted from the last
            `suffix_max_tree_depth - 1` tokens. In 1..128 (each token costs up to this many tree nodes).
        suffix_max_cached_requests (`int`, defaults to 10000):
            `method="suffix"`: earlier outputs the global tree keeps (the oldest are taken out first); 0 turns the
            global tree off (drafts then come from each row's own prompt and output only).
        suffix_max_cached_tokens (`int`, defaults to 100000):
            `method="suffix"`: the global tree's memory bound, in tokens over all kept outputs (oldest out first).
            A token costs at most `suffix_max_tree_depth` nodes of about 64 bytes: about 1.5 KB a token at depth 24
            on real text, so the default bounds the tree to about 150 MB.
        suffix_max_spec_factor (`float`, defaults to 1.0):
            `method="suffix"`: a match of m tokens drafts at most `m * suffix_max_spec_factor` tokens.
        suffix_min_token_prob (`float`, defaults to 0.1):
            `method="suffix"`: a draft stops where the product of the tree's branch probabilities along it falls
            below this (in 0..1).
        seed (`int` or `list[int]`, *optional*):
            Seed of the sampling draws, each in 0..2**63 - 1. An int gives row i of a batch the seed
            `seed + i`; a list gives one seed per row (its length must be the batch size), so the same
            request can keep its seed at any position of any batch. A row's draws depend only on its seed,
            never on the other rows, and so does its output (with the `"constant"` or `"heuristic_transient"`
            schedule and no `draft_confidence_threshold`), except where a draw is decided within the last bits
            that another batch shape or left padding moves in the logits, e.g. at a top-p cut-off (docs/usage.md,
            "Seeds and reproducibility"). The other schedules choose draft lengths from measured step times,
            earlier calls or the whole batch's history, which changes the draws but never the
            distribution. Without a seed, seeds are drawn from torch's global generator (so
            `torch.manual_seed` makes runs reproducible).
        tokenizer (`PreTrainedTokenizerBase`, *optional*):
            Needed for `stop_strings`; `generate` does not forward its `tokenizer` to custom decoders.
        streamer (`BaseStreamer`, *optional*):
            Receives the tokens like `generate(streamer=...)` would.
        on_step (`Callable[[StepRecord], None]`, *optional*):
            Called after every verify step with a `hf_specdec.metrics.StepRecord`: each generating row's kept
            tokens and how they came (accepted draft, recovered after a rejection, bonus). For visualising
            speculation (the Space colours tokens with it); it costs one host copy per step, none when unset.
    """

    method: str | None = None
    draft_model: Any = None
    draft_head: Any = None
    draft_tokenizer: Any = None
    mtp_model: Any = None
    early_exit_layers: int | None = None
    num_speculative_tokens: int | None = None  # None: 5, or `DEFAULT_SPECULATIVE_TOKENS[method]`
    num_speculative_tokens_schedule: str = "adaptive"
    draft_confidence_threshold: float | None = None
    max_draft_len: int | None = None
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    suffix_max_tree_depth: int = SUFFIX_DEFAULTS["suffix_max_tree_depth"]
    suffix_max_cached_requests: int = SUFFIX_DEFAULTS["suffix_max_cached_requests"]
    suffix_max_cached_tokens: int = SUFFIX_DEFAULTS["suffix_max_cached_tokens"]
    suffix_max_spec_factor: float = SUFFIX_DEFAULTS["suffix_max_spec_factor"]
    suffix_min_token_prob: float = SUFFIX_DEFAULTS["suffix_min_token_prob"]
    seed: int | list[int] | None = None
    tokenizer: Any = None
    streamer: Any = None
    on_step: Any = None
    last_stats: SpecDecodeStats | None = field(default=None, init=False, repr=False, compare=False)
    #: `method="suffix"`: the global tree over earlier outputs, kept across calls (`proposers.suffix_cache`)
    suffix_cache: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.method is None and self.draft_head is not None:
            self.method = "eagle3"
        if self.method is None:
            self.method = "draft" if self.draft_model is not None else "ngram"
            if type(self.draft_model).__name__.startswith(("Gemma4Assistant", "Gemma4UnifiedAssistant")):
                self.method = "gemma4_assistant"
            if self.draft_model is None and self.early_exit_layers is not None:
                self.method = "early_exit"
        if self.method not in METHODS:
            raise ValueError(f"SpecDecoder(method={self.method!r}) is not a known method: pass one of {METHODS}.")
        if self.method in DRAFT_MODEL_METHODS and self.draft_model is None:
            raise ValueError(
                f"SpecDecoder(method={self.method!r}) needs a draft model: pass draft_model=<the draft or assistant "
                "model>, or use method='ngram' for prompt lookup without a draft."
            )
        if self.method == "eagle3" and self.draft_head is None:
            raise ValueError(
                "SpecDecoder(method='eagle3') needs an EAGLE-3 head: pass draft_head=hf_specdec.load_draft_head(path)."
            )
        if self.method != "eagle3" and self.draft_head is not None:
            raise ValueError(
                f"SpecDecoder(method={self.method!r}) was also given a draft_head, which only method='eagle3' uses: "
                "drop draft_head, or drop method (a draft_head selects method='eagle3')."
            )
        if self.method != "mtp" and self.mtp_model is not None:
            raise ValueError(
                f"SpecDecoder(method={self.method!r}) was also given an mtp_model, which only method='mtp' uses: "
                "drop mtp_model, or use method='mtp'."
            )
        if self.method not in (*DRAFT_MODEL_METHODS, "suffix") and self.draft_model is not None:
            raise ValueError(
                f"SpecDecoder(method={self.method!r}) was also given a draft_model, which that method would ignore: "
                "drop draft_model, or use method='draft' (or method='suffix': suffix decoding with the draft model "
                "where the suffix trees have nothing better)."
            )
        self._check_early_exit()
        if self.draft_tokenizer is not None:
            if self.method != "draft":
                raise ValueError(
                    f"SpecDecoder(method={self.method!r}) was also given a draft_tokenizer, which only method='draft' "
                    "uses: drop draft_tokenizer, or pass draft_model= as well."
                )
            if self.draft_confidence_threshold:
                raise ValueError(
                    f"draft_confidence_threshold={self.draft_confidence_threshold} does not apply to a draft with "
                    "another tokenizer (its probabilities are over another vocabulary): drop it."
                )
        if self.num_speculative_tokens is None:
            self.num_speculative_tokens = DEFAULT_SPECULATIVE_TOKENS.get(self.method, 5)
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an int in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}: "
                "typical values are 3-8 (more only pays when nearly every draft is accepted)."
            )
        self._check_schedule_options()
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if not isinstance(lo, int) or not isinstance(hi, int) or lo < 1 or hi < lo:
            raise ValueError(
                f"prompt_lookup_min/prompt_lookup_max must be ints with 1 <= min <= max, got min={lo!r}, max={hi!r}."
            )
        self._check_suffix()
        self._check_seed()
        if self.on_step is not None and not callable(self.on_step):
            raise ValueError(
                f"SpecDecoder(on_step=...) must be a callable taking a StepRecord, got {type(self.on_step).__name__}."
            )

    @property
    def max_speculative_tokens(self) -> int:
        """The most drafts any row may get in one step (the heuristic schedules may grow k up to 32)."""
        if self.num_speculative_tokens_schedule.startswith("heuristic"):
            return MAX_SPECULATIVE_TOKENS
        return self.num_speculative_tokens

    def _check_schedule_options(self) -> None:
        if self.num_speculative_tokens_schedule not in SCHEDULES:
            raise ValueError(
                f"num_speculative_tokens_schedule must be one of {SCHEDULES}, got "
                f"{self.num_speculative_tokens_schedule!r}: use 'adaptive' to let hf_specdec pick k per row from "
                "measured acceptance and costs, or 'constant' for a fixed k."
            )
        threshold = self.draft_confidence_threshold
        if threshold is not None:
            if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 <= threshold < 1:
                raise ValueError(
                    f"draft_confidence_threshold must be a float in [0, 1) or None, got {threshold!r}: HF's default "
                    "is 0.4; 0 or None turns it off."
                )
            if threshold > 0 and self.method not in ("draft", "early_exit"):
                raise ValueError(
                    f"draft_confidence_threshold={threshold} only applies to method='draft' or 'early_exit' (it reads "
                    f"the draft's probabilities), but method={self.method!r}: drop draft_confidence_threshold."
                )
        limit = self.max_draft_len
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 2):
            raise ValueError(
                f"max_draft_len must be an int >= 2 or None, got {limit!r}: it is the sequence length (prompt + "
                "generated tokens) past which rows stop speculating."
            )

    def _check_early_exit(self) -> None:
        layers = self.early_exit_layers
        if self.method != "early_exit":
            if layers is not None:
                raise ValueError(
                    f"SpecDecoder(method={self.method!r}) was also given early_exit_layers={layers!r}, which only "
                    "method='early_exit' uses: drop early_exit_layers, or use method='early_exit'."
                )
            return
        if isinstance(layers, bool) or not isinstance(layers, int) or layers < 1:
            raise ValueError(
                f"SpecDecoder(method='early_exit') needs early_exit_layers, an int >= 1 (the number of the target's "
                f"first layers that draft), got {layers!r}: e.g. early_exit_layers=4."
            )

    def _check_suffix(self) -> None:
        if self.method != "suffix":
            changed = [name for name, default in SUFFIX_DEFAULTS.items() if getattr(self, name) != default]
            if changed:
                raise ValueError(
                    f"SpecDecoder(method={self.method!r}) was also given {', '.join(changed)}, which only "
                    "method='suffix' uses: drop them, or use method='suffix'."
                )
            return

        def integer(name: str, low: int, high: int | None, hint: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low or (high and value > high):
                bounds = f"in {low}..{high}" if high else f">= {low}"
                raise ValueError(f"{name} must be an int {bounds}, got {value!r}: {hint}")

        integer("suffix_max_tree_depth", 1, 128, "vLLM's default is 24 (each token costs up to this many tree nodes).")
        integer("suffix_max_cached_requests", 0, None, "earlier outputs kept in the global tree; 0 turns it off.")
        integer(
            "suffix_max_cached_tokens", 0, None, "the global tree's bound in tokens (default 100000, about 150 MB)."
        )
        factor = self.suffix_max_spec_factor
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 64:
            raise ValueError(
                f"suffix_max_spec_factor must be a number in (0, 64], got {factor!r}: a match of m tokens drafts at "
                "most m * suffix_max_spec_factor tokens (vLLM's default is 1.0)."
            )
        prob = self.suffix_min_token_prob
        if isinstance(prob, bool) or not isinstance(prob, (int, float)) or not 0 <= prob <= 1:
            raise ValueError(
                f"suffix_min_token_prob must be a probability in [0, 1], got {prob!r}: drafts stop where the tree's "
                "branch probability falls below it (vLLM's default is 0.1)."
            )

    def _check_seed(self) -> None:
        def valid(s: Any) -> bool:
            return isinstance(s, int) and not isinstance(s, bool) and 0 <= s < 2**63

        if isinstance(self.seed, (list, tuple)):
            if not self.seed or not all(valid(s) for s in self.seed):
                raise ValueError(
                    f"seed must be an int in 0..2**63 - 1, a non-empty list of such ints (one per row), or None; "
                    f"got the list {list(self.seed)!r}."
                )
            self.seed = list(self.seed)
        elif self.seed is not None and not valid(self.seed):
            raise ValueError(
                f"seed must be an int in 0..2**63 - 1, a list of such ints (one per row), or None; got {self.seed!r}."
            )

    def to_dict(self) -> dict[str, Any]:
        """The serialisable settings (model, tokenizer and streamer objects are left out)."""
        skip = {
            "draft_model",
            "draft_head",
            "draft_tokenizer",
            "mtp_model",
            "tokenizer",
            "streamer",
            "on_step",
            "last_stats",
            "suffix_cache",
        }
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}

    @classmethod
    def from_dict(cls, data: dict[str, Any], **objects: Any) -> SpecDecoder:
        """Inverse of `to_dict`; pass `draft_model=`, `draft_head=`, `draft_tokenizer=`, `mtp_model=`, `tokenizer=`, `streamer=`, `on_step=` as keyword arguments."""
        known = {f.name for f in fields(cls) if f.init}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"SpecDecoder.from_dict got unknown keys {sorted(unknown)}; known keys: {sorted(known)}.")
        return cls(**data, **objects)
