"""Shared fixtures: tiny random HF models built from configs (no downloads), prompts, marks."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    GemmaConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen3Config,
)

VOCAB = 96
EOS_ID = 2
PAD_ID = 0

torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def tiny_config_kwargs(vocab: int, layers: int, hidden: int) -> dict:
    """The config fields every tiny test model shares (architecture-specific ones are added by the caller)."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        pad_token_id=PAD_ID,
        initializer_range=0.4,
    )


def make_config(arch: str, vocab: int = VOCAB, layers: int = 2, hidden: int = 64, **overrides):
    """A tiny config of one of the architectures the tests cover."""
    if arch == "llama":
        config = LlamaConfig(**tiny_config_kwargs(vocab, layers, hidden), tie_word_embeddings=False)
    elif arch == "qwen3":
        config = Qwen3Config(**tiny_config_kwargs(vocab, layers, hidden), head_dim=16, tie_word_embeddings=True)
    elif arch == "mistral":
        config = MistralConfig(**tiny_config_kwargs(vocab, layers, hidden), sliding_window=8)
    elif arch == "gemma":
        config = GemmaConfig(**tiny_config_kwargs(vocab, layers, hidden), head_dim=16)
    elif arch == "phi3":
        config = Phi3Config(**tiny_config_kwargs(vocab, layers, hidden))
    elif arch == "gpt2":
        config = GPT2Config(
            vocab_size=vocab,
            n_embd=hidden,
            n_layer=layers,
            n_head=4,
            n_positions=512,
            bos_token_id=1,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
            initializer_range=0.4,
        )
    else:
        raise ValueError(f"unknown test architecture {arch!r}")
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


ARCHS = ("llama", "qwen3", "mistral", "gpt2", "gemma", "phi3")


def make_model(arch: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A tiny random causal LM (fp32, eval mode, sdpa) with a fixed seed."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(make_config(arch, **overrides), attn_implementation="sdpa")
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    return model.eval()


def make_prompts(
    batch_size: int, vocab: int = VOCAB, min_len: int = 3, max_len: int = 12, seed: int = 0, repetitive: bool = True
) -> dict[str, torch.Tensor]:
    """A left-padded batch of random prompts of different lengths (repetitive so n-gram lookup finds matches)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (batch_size,), generator=g).tolist()
    width = max(lengths)
    input_ids = torch.full((batch_size, width), PAD_ID, dtype=torch.long)
    attention_mask = torch.zeros(batch_size, width, dtype=torch.long)
    for i, n in enumerate(lengths):
        if repetitive:
            motif = torch.randint(3, vocab, (max(2, n // 3),), generator=g)
            row = motif.repeat(n // len(motif) + 1)[:n]
        else:
            row = torch.randint(3, vocab, (n,), generator=g)
        input_ids[i, width - n :] = row
        attention_mask[i, width - n :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


@pytest.fixture(scope="module", params=ARCHS)
def arch_models(request: pytest.FixtureRequest) -> tuple[str, torch.nn.Module, torch.nn.Module]:
    """(arch, target, a smaller draft of the same architecture) for each architecture the tests cover."""
    arch = request.param
    return arch, make_model(arch, seed=0), make_model(arch, seed=1, layers=1, hidden=32)


@pytest.fixture(scope="session")
def llama() -> torch.nn.Module:
    return make_model("llama", seed=0)


@pytest.fixture(scope="session")
def llama_draft() -> torch.nn.Module:
    return make_model("llama", seed=1, layers=1, hidden=32)


@pytest.fixture(autouse=True)
def fixed_k_by_default(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests build `SpecDecoder`s with a fixed k unless they name a schedule.

    The library's default is the adaptive schedule, which (rightly) decodes plainly where drafts do not pay; on
    tiny CPU models that can be most steps, so exactness tests would stop exercising wide verifies, holes and
    rejections. Tests of the default itself carry `@pytest.mark.library_default` and see the real default; the
    adaptive schedule has its own exactness tests (tests/test_adaptive.py, tests/core/test_install.py).
    """
    if request.node.get_closest_marker("library_default") is None:
        from hf_specdec.config import SpecDecoder

        monkeypatch.setitem(SpecDecoder.__init__.__kwdefaults__, "num_speculative_tokens_schedule", "constant")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: loads the real SmolLM2 model or runs long; CI runs them too")
    config.addinivalue_line("markers", "requires_cuda: needs a CUDA GPU; skipped without one")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (CI has none: not a failure)")
    for item in items:
        if "requires_cuda" in item.keywords:
            item.add_marker(skip)


def make_noisy_copy(model: torch.nn.Module, noise: float = 0.05, seed: int = 7) -> torch.nn.Module:
    """A draft that agrees with `model` most of the time: its weights plus Gaussian noise (ragged acceptance)."""
    import copy

    g = torch.Generator().manual_seed(seed)
    draft = copy.deepcopy(model)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g).to(p.device) * noise * p.abs().mean())  # same draws on any device
    return draft.eval()


def spec_generate(model, inputs: dict, spec, **kwargs):
    """model.generate through hf_specdec's custom_generate entry."""
    import hf_specdec

    return model.generate(**inputs, custom_generate=hf_specdec.generate, spec_decoder=spec, **kwargs)


def make_tokenizer(vocab: int = VOCAB, padding_side: str = "left"):
    """A tiny real fast tokenizer, built offline: WordPiece over letters, digits and pieces, ids matching the tiny models.

    Any lowercase/digit text encodes (which `StopStringCriteria` needs); ids 0-2 are pad, bos and eos.
    """
    import string

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = string.ascii_lowercase + string.digits
    pieces = ["<pad>", "<s>", "</s>", "<unk>", *chars, *(f"##{c}" for c in chars)]
    pieces += [f"##{a}{b}" for a in "etaoins" for b in "hnrtesd" if a != b][: vocab - len(pieces)]
    assert len(pieces) == vocab, len(pieces)
    backend = Tokenizer(models.WordPiece(vocab={p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side=padding_side,
        clean_up_tokenization_spaces=False,
    )


#: A small English corpus for the tiny BPE tokenizers (`make_bpe_tokenizer`).
BPE_CORPUS = [
    "the cat sat on the mat and the dog sat on the log",
    "a quick brown fox jumps over the lazy dog near the river bank",
    "speculative decoding drafts tokens that the target model then verifies in one forward pass",
    "she sells sea shells on the sea shore and the shells she sells are surely sea shells",
    "to be or not to be that is the question whether tis nobler in the mind to suffer",
    "numbers like 12 34 56 and 789 appear in text now and then",
]


def make_bpe_tokenizer(vocab_size: int, padding_side: str = "left"):
    """A real BPE tokenizer trained in-process on `BPE_CORPUS` (no download): ids 0-2 are pad, bos, eos.

    Different `vocab_size`s give different merges, so two of them tokenize the same text differently.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="never")
    backend.decoder = decoders.Metaspace(prepend_scheme="never")
    alphabet = list("abcdefghijklmnopqrstuvwxyz0123456789")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"], initial_alphabet=alphabet
    )
    backend.train_from_iterator(BPE_CORPUS * 4, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        padding_side=padding_side,
        clean_up_tokenization_spaces=False,
    )


def make_whisper(seed: int = 0, decoder_layers: int = 2, causal: bool = False, d_model: int = 32):
    """A tiny random Whisper (8 mel bins, 16 frames after the conv stride), or its decoder as `WhisperForCausalLM`.

    Its generation_config knows two languages, two tasks and timestamp tokens 81..95 (no-timestamps id 80).
    """
    from transformers import WhisperConfig, WhisperForCausalLM, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB,
        num_mel_bins=8,
        encoder_layers=1,
        decoder_layers=decoder_layers,
        d_model=d_model,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=2 * d_model,
        decoder_ffn_dim=2 * d_model,
        max_source_positions=16,
        max_target_positions=64,
        pad_token_id=PAD_ID,
        bos_token_id=1,
        eos_token_id=EOS_ID,
        decoder_start_token_id=1,
        begin_suppress_tokens=None,
        suppress_tokens=None,
        init_std=0.4,
    )
    torch.manual_seed(seed)
    model = (WhisperForCausalLM if causal else WhisperForConditionalGeneration)(config).eval()
    generation = model.generation_config
    generation.no_timestamps_token_id = 80
    generation.lang_to_id = {"<|en|>": 70, "<|fr|>": 71}
    generation.task_to_id = {"transcribe": 72, "translate": 73}
    generation.is_multilingual = True
    generation.max_initial_timestamp_index = 5
    return model


def make_seq2seq(arch: str, seed: int = 0, decoder_layers: int = 2, vocab: int = VOCAB):
    """A tiny random BART, Marian or T5 (encoder-decoder text models whose decoders take no position ids)."""
    from transformers import (
        BartConfig,
        BartForConditionalGeneration,
        MarianConfig,
        MarianMTModel,
        T5Config,
        T5ForConditionalGeneration,
    )

    shared = dict(
        vocab_size=vocab,
        d_model=32,
        encoder_layers=1,
        decoder_layers=decoder_layers,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        forced_eos_token_id=None,
        init_std=0.4,
    )
    if arch == "marian":
        config = MarianConfig(**shared, decoder_start_token_id=PAD_ID)
        cls = MarianMTModel
    elif arch == "bart":
        config = BartConfig(**shared, bos_token_id=1, decoder_start_token_id=EOS_ID, forced_bos_token_id=None)
        cls = BartForConditionalGeneration
    else:
        config = T5Config(
            vocab_size=vocab,
            d_model=32,
            d_kv=8,
            d_ff=64,
            num_layers=decoder_layers,
            num_decoder_layers=decoder_layers,
            num_heads=4,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            decoder_start_token_id=PAD_ID,
            initializer_factor=4.0,
        )
        cls = T5ForConditionalGeneration
    torch.manual_seed(seed)
    return cls(config).eval()


def make_word_tokenizer(words: list[str], padding_side: str = "left"):
    """A real word-level tokenizer (no download): ids 0-2 are pad, bos, eos, then `words` in order."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", *words])}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="</s>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        bos_token="<s>",
        eos_token="</s>",
        padding_side=padding_side,
        clean_up_tokenization_spaces=False,
    )


def make_gemma4(
    seed: int = 0,
    vocab: int = VOCAB,
    initializer_range: float = 0.1,
    shared_layers: int = 2,
    layers: int = 4,
    hidden: int = 64,
    global_head_dim: int = 16,
):
    """A tiny random Gemma 4 text model: sliding (window 4, head dim 16) and full layers (`global_head_dim`), the
    last `shared_layers` sharing the keys of earlier ones (`num_kv_shared_layers`), per-layer inputs. Its greedy
    output mixes repeats and changes."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    config = Gemma4TextConfig(
        **{**tiny_config_kwargs(vocab, layers, hidden), "initializer_range": initializer_range},
        head_dim=16,
        global_head_dim=global_head_dim,
        sliding_window=4,
        layer_types=["sliding_attention", "full_attention"] * (layers // 2),
        num_kv_shared_layers=shared_layers,
        hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=vocab,
    )
    model = Gemma4ForCausalLM._from_config(config, attn_implementation="sdpa")
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    return model.eval()


def make_gemma4_assistant(target: torch.nn.Module, seed: int = 1, echo: float = 1.0, global_head_dim: int = 16):
    """A tiny Gemma 4 assistant for `target`, leaning (by `echo`) towards drafting the token it is fed again.

    Test-factory workaround: transformers 5.23's `Gemma4TextConfig.kv_sharing_modes` raises when every layer
    shares its keys (which a Gemma4AssistantConfig requires), so the assistant is built with that property patched
    for the duration of the constructor (all layers "reuse")."""
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    text = Gemma4TextConfig(
        **{**tiny_config_kwargs(target.config.vocab_size, 2, 32), "initializer_range": 0.05},
        head_dim=16,
        global_head_dim=global_head_dim,  # the target's full layers' head dim
        sliding_window=target.config.sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        num_kv_shared_layers=2,
        hidden_size_per_layer_input=0,
        vocab_size_per_layer_input=0,
    )
    config = Gemma4AssistantConfig(text_config=text, backbone_hidden_size=target.config.hidden_size)
    original = getattr(Gemma4TextConfig, "kv_sharing_modes", None)  # a property since transformers 5.2x

    def all_shared(self):  # noqa: ANN001, ANN202
        if self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original.fget(self)

    torch.manual_seed(seed)
    if original is not None:
        Gemma4TextConfig.kv_sharing_modes = property(all_shared)
    try:
        assistant = Gemma4AssistantForCausalLM._from_config(config, attn_implementation="sdpa")
    finally:
        if original is not None:
            Gemma4TextConfig.kv_sharing_modes = original
    with torch.no_grad():  # the head scores each token by how well it matches the fed token's projected embedding
        embeds = target.get_input_embeddings().weight  # [V, H_target]
        assistant.pre_projection.weight[:, : embeds.shape[1]] *= 1 + 30 * echo  # the fed token dominates
        projected = embeds @ assistant.pre_projection.weight[:, : embeds.shape[1]].T  # [V, H]
        head = torch.nn.functional.normalize(projected, dim=-1) * 8.0
        assistant.lm_head.weight.mul_(1 - echo).add_(echo * head)
    return assistant.eval()


def make_dflash_drafter(target: torch.nn.Module, seed: int = 1, block_size: int = 5, sliding_window: int = 64):
    """A tiny random DFlash drafter (`MuseGlimmerAssistantModel`) for `target`: a sliding and a full layer, reading
    the target's first and last layers' states. Keep sliding_window above the tests' lengths to compare with
    transformers' own forward (without a cache, its bidirectional window does not offset the block's positions)."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    text = target.config.get_text_config()
    config = MuseGlimmerAssistantConfig(
        **tiny_config_kwargs(text.vocab_size, 2, text.hidden_size),
        head_dim=16,
        sliding_window=sliding_window,
        layer_types=["sliding_attention", "full_attention"],
        block_size=block_size,
        mask_token_id=3,
        target_layer_ids=[0, text.num_hidden_layers - 1],
    )
    torch.manual_seed(seed)
    return MuseGlimmerAssistantModel._from_config(config, attn_implementation="sdpa").eval()


def filled_cache_call(model, inputs: dict) -> tuple[dict, object]:  # noqa: ANN001
    """A `DynamicCache` that `model` filled with `inputs` (2 rows), and those rows two tokens longer: the arguments of
    a call that continues a filled `past_key_values`."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    model(**inputs, past_key_values=cache)
    longer = {
        "input_ids": torch.cat([inputs["input_ids"], torch.full((2, 2), 7)], 1),
        "attention_mask": torch.cat([inputs["attention_mask"], torch.ones(2, 2, dtype=torch.long)], 1),
    }
    return longer, cache


def record_proposals(monkeypatch: pytest.MonkeyPatch, proposer_class: type) -> list[tuple[torch.Tensor, ...]]:
    """Each `proposer_class.propose` call's (token rows [B, C], lengths [B], pad lengths [B], drafts [B, k])."""
    steps = []
    propose = proposer_class.propose

    def recording(proposer, batch, max_draft_tokens, sampling, width=None):  # noqa: ANN001, ANN202
        rows = batch.token_ids.clone()
        proposal = propose(proposer, batch, max_draft_tokens, sampling, width)
        steps.append((rows, batch.lengths.clone(), batch.pad_lengths.clone(), proposal.draft_token_ids))
        return proposal

    monkeypatch.setattr(proposer_class, "propose", recording)
    return steps


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; two spin-wait badly on a shared 2-core machine (up to 100x slower).
    A test module opts in with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def adopted(monkeypatch) -> list[bool]:
    """Graph reuse on (its default), and per captured call in order, whether it adopted a kept entry's graphs."""
    from hf_specdec import graph_reuse
    from hf_specdec.step_graph import StepGraph

    monkeypatch.delenv(graph_reuse.REUSE_ENV, raising=False)
    adopted: list[bool] = []
    reuse = StepGraph._reuse
    monkeypatch.setattr(StepGraph, "_reuse", lambda self: (reuse(self), adopted.append(self.entry is not None)))
    return adopted


@pytest.fixture
def emulated_graphs(monkeypatch):
    """Captured static steps on the CPU: `hf_specdec.step_graph.GRAPHS` emulates CUDA graphs (emulated_graphs.py)."""
    from emulated_graphs import EmulatedGraphs

    from hf_specdec import step_graph

    monkeypatch.setattr(step_graph, "GRAPHS", EmulatedGraphs)
