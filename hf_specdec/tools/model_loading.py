"""Model loading for the CLI, the examples and the benchmarks: real checkpoints, SmolLM2 offline, tiny random Llamas.

`load_model("smollm2")` loads the offline SmolLM2-135M-Instruct (see `hf_specdec.tools.smollm`); `load_model("tiny")`
builds a tiny random Llama target from a config, and `tiny_models()` gives a target plus a smaller draft that share
its vocabulary and a small byte-level BPE tokenizer trained in memory, so everything runs with no checkpoint at all.
Any other name is passed to `from_pretrained` (a local directory, or a hub id when a hub is reachable).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["TINY", "SMOLLM2", "load_model", "load_tokenizer", "resolve_device", "resolve_dtype", "tiny_models"]

SMOLLM2 = "smollm2"
TINY = "tiny"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_TINY_CORPUS = [
    "The quick brown fox jumps over the lazy dog. Speculative decoding drafts tokens and verifies them at once.",
    "def add(a, b):\n    return a + b\n\nclass Counter:\n    def __init__(self):\n        self.count = 0\n",
    "Summarize the article above. Translate into German. Answer the question. Write a short story about a robot.",
    "1 2 3 4 5 6 7 8 9 10 + - * / = ( ) [ ] { } : ; , . ! ? ' \" # @ % & < > | \\ ~ ^ _ `",
    "import torch\nfrom transformers import AutoModelForCausalLM\nmodel.generate(**inputs, max_new_tokens=32)\n",
]
_tiny_cache: dict[int, tuple[Any, Any, Any]] = {}


def resolve_device(device: str) -> torch.device:
    """Map ``"auto"``, ``"cpu"``, ``"cuda"`` (or ``"cuda:N"``) to a `torch.device`, checking that CUDA exists."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {device} was requested but torch sees no CUDA GPU: pass --device cpu (or auto).")
    try:
        return torch.device(device)
    except RuntimeError as err:
        raise ValueError(f"--device {device!r} is not a device torch knows: pass cpu, cuda, cuda:N or auto.") from err


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """Map ``"auto"`` (bfloat16 on CUDA, float32 on CPU) or a dtype name to a `torch.dtype`."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported: pass one of auto, {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def _tiny_tokenizer() -> Any:
    """A byte-level BPE tokenizer (vocab 512) trained in memory on a few sentences; deterministic, no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_TINY_CORPUS * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.padding_side = "left"
    return fast


def tiny_models(seed: int = 0, device: str | torch.device = "cpu") -> tuple[Any, Any, Any]:
    """Build a tiny random Llama target, a smaller draft and their shared tokenizer (cached per seed).

    The draft is the target's first decoder layer with the target's embeddings, final norm and LM head, and the
    target's later layers are damped, so the draft's guesses agree with the target's most of the time and
    speculative decoding accepts a useful share of them (as with a real draft of the same family).

    Args:
        seed (`int`, *optional*, defaults to 0): seed of the random weights.
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`): where both models go.

    Returns:
        `tuple[LlamaForCausalLM, LlamaForCausalLM, PreTrainedTokenizerFast]`: target, draft, tokenizer.
    """
    if seed not in _tiny_cache:
        from transformers import LlamaConfig, LlamaForCausalLM

        tokenizer = _tiny_tokenizer()
        common = dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=8192,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            tie_word_embeddings=False,
        )
        torch.manual_seed(seed)
        target = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, **common)).eval()
        draft = LlamaForCausalLM(LlamaConfig(num_hidden_layers=1, **common)).eval()
        state = {k: v for k, v in target.state_dict().items() if not k.startswith("model.layers.") or ".layers.0." in k}
        draft.load_state_dict(state)
        with torch.no_grad():  # damp the target's later layers so the draft agrees with it ~80% of the time
            for layer in target.model.layers[1:]:
                layer.self_attn.o_proj.weight.mul_(0.2)
                layer.mlp.down_proj.weight.mul_(0.2)
        for model in (target, draft):
            model.generation_config.pad_token_id = tokenizer.pad_token_id
            model.generation_config.eos_token_id = tokenizer.eos_token_id
            model.generation_config.bos_token_id = tokenizer.bos_token_id
        _tiny_cache[seed] = (target, draft, tokenizer)
    target, draft, tokenizer = _tiny_cache[seed]
    return target.to(device), draft.to(device), tokenizer


def load_tokenizer(name_or_path: str, gguf_file: str | None = None) -> Any:
    """Load the tokenizer of `name_or_path` (left padding, pad token set); special names as in `load_model`."""
    if name_or_path == TINY:
        return tiny_models()[2]
    if name_or_path == SMOLLM2:
        from hf_specdec.tools.smollm import load_smollm2

        return load_smollm2()[1]
    from transformers import AutoTokenizer

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name_or_path: str,
    *,
    gguf_file: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    role: str = "target",
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer for the CLI.

    Args:
        name_or_path (`str`):
            ``"smollm2"`` (offline SmolLM2-135M-Instruct), ``"tiny"`` (tiny random Llama; with ``role="draft"`` the
            tiny draft), a local directory, or a hub id.
        gguf_file (`str`, *optional*): a GGUF file inside `name_or_path` to load (dequantised).
        device (`str`, *optional*, defaults to `"auto"`): ``cpu``, ``cuda``, ``cuda:N`` or ``auto``.
        dtype (`str`, *optional*, defaults to `"auto"`): ``float32``, ``bfloat16``, ``float16`` or ``auto``.
        role (`str`, *optional*, defaults to `"target"`): ``"target"`` or ``"draft"`` (only matters for ``tiny``).

    Returns:
        `tuple[PreTrainedModel, PreTrainedTokenizerBase]`: the model in eval mode on `device`, and its tokenizer.
    """
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    if name_or_path == TINY:
        target, draft, tokenizer = tiny_models(device=dev)
        return (draft if role == "draft" else target).to(torch_dtype), tokenizer
    if name_or_path == SMOLLM2:
        from hf_specdec.tools.smollm import load_smollm2

        return load_smollm2(dtype=torch_dtype, device=dev)
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=torch_dtype, **kwargs)
    except OSError as err:
        raise ValueError(
            f"Could not load a model from {name_or_path!r} ({err.__class__.__name__}: {str(err).splitlines()[0]}). "
            f"Pass a local directory with config.json and weights, '{SMOLLM2}' for the offline SmolLM2, "
            f"or '{TINY}' for a tiny random model."
        ) from err
    model.to(dev).eval()
    tokenizer = load_tokenizer(name_or_path, gguf_file)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model, tokenizer
