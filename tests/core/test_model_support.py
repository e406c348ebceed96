"""Every causal LM of the installed transformers runs greedy-identical to plain `generate`, or is refused up front.

The sweep builds each class of `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` from its config's defaults shrunk to a tiny
size (common attribute names), runs plain greedy `generate` on a left-padded batch of 2, then hf_specdec with a
self-draft (every draft accepted: wide verifies) and with n-gram lookup (rejections: holes). Each class is
"identical", "refused" (a clear hf_specdec error before any model work) or "skipped" (it cannot build from a tiny
config or plain generate fails on it); a silent difference or a crash fails the test. Counts are printed.
"""

from __future__ import annotations

import importlib
import warnings

import torch
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import hf_specdec
from hf_specdec.model_support import check_alibi_call, check_supported_cache
from hf_specdec.recurrent import check_recurrent_call

SHRINK = {
    "vocab_size": 128,
    "hidden_size": 32,
    "n_embd": 32,
    "d_model": 32,
    "embed_dim": 32,
    "num_hidden_layers": 2,
    "n_layer": 2,
    "num_layers": 2,
    "n_layers": 2,
    "intermediate_size": 64,
    "n_inner": 64,
    "ffn_dim": 64,
    "ffn_hidden_size": 64,
    "num_attention_heads": 4,
    "n_head": 4,
    "n_heads": 4,
    "num_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 128,
    "n_positions": 128,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
NEW_TOKENS = 6


def tiny_config(model_type: str):
    """The config class's defaults shrunk via common attribute names, or None when it does not build."""
    default = AutoConfig.for_model(model_type)
    kwargs = {key: value for key, value in SHRINK.items() if hasattr(default, key)}
    layer_types = getattr(default, "layer_types", None)
    if layer_types and not isinstance(getattr(type(default), "layer_types", None), property):
        kinds = list(dict.fromkeys(layer_types))  # keep one layer of every kind (hybrids stay hybrid)
        num_layers = max(2, len(kinds))
        kwargs["layer_types"] = (kinds * num_layers)[:num_layers]
        for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if key in kwargs:
                kwargs[key] = num_layers
    elif layer_types:  # derived from a pattern: keep enough layers to reach the first attention layer
        attention = [i for i, kind in enumerate(layer_types) if "attention" in kind]
        num_layers = max(2, attention[0] + 1 if attention else 2)
        for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
            if key in kwargs:
                kwargs[key] = num_layers
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except Exception:  # noqa: BLE001 -- some configs validate layer_types against a pattern: keep their default
        kwargs.pop("layer_types", None)
        return AutoConfig.for_model(model_type, **kwargs)


#: A class whose tiny config still has more parameters than this did not shrink (a multimodal wrapper whose vision
#: tower keeps its defaults: gemma3, mllama, fuyu, ... have billions): building it would take minutes and
#: gigabytes, so it is skipped (its text model, where transformers maps one, is swept on its own).
MAX_PARAMETERS = 20_000_000


def parameter_count(cls: type, config) -> int:  # noqa: ANN001
    """Parameters of `cls(config)`, counted on the meta device (no memory, no init)."""
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return sum(p.numel() for p in cls._from_config(config).parameters())


def build(model_type: str, class_name: str) -> torch.nn.Module | None | int:
    """The tiny model, None when it does not build, or its parameter count when that is above MAX_PARAMETERS."""
    try:
        config = tiny_config(model_type)
        module = importlib.import_module("transformers")
        cls = getattr(module, class_name)
        count = parameter_count(cls, config)
        if count > MAX_PARAMETERS:
            return count
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                model = cls._from_config(config, attn_implementation="sdpa")
            except (ValueError, ImportError):
                model = cls._from_config(config, attn_implementation="eager")
        model.generation_config.pad_token_id = 0
        model.generation_config.eos_token_id = None
        model.generation_config.use_cache = True  # MPT's config defaults to False; the outputs are the same
        return model.eval()
    except Exception:  # noqa: BLE001 -- any class that cannot build from a tiny config is skipped
        return None


def prompts() -> dict[str, torch.Tensor]:
    ids = torch.tensor([[0, 0, 5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 12, 9, 10, 11, 12, 9, 10]])
    mask = (ids != 0).long()
    return {"input_ids": ids, "attention_mask": mask}


def sweep_one(model_type: str, class_name: str) -> tuple[str, str]:
    """(outcome, detail): identical / refused / skipped, or different / crashed (failures)."""
    model = build(model_type, class_name)
    if model is None:
        return "skipped", "does not build from a tiny config"
    if isinstance(model, int):
        return "skipped", f"its tiny config still has {model / 1e6:.0f}M parameters (a part did not shrink)"
    inputs = prompts()
    vocab = model.get_output_embeddings().weight.shape[0] if model.get_output_embeddings() is not None else 0
    if vocab and vocab < 16:
        return "skipped", f"tiny output vocabulary {vocab}"
    try:
        with torch.no_grad():
            plain = model.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    except Exception as error:  # noqa: BLE001
        return "skipped", f"plain generate fails: {type(error).__name__}"
    try:
        check_supported_cache(model)
        check_alibi_call(model, "target", len(inputs["input_ids"]), not inputs["attention_mask"].all(), static=False)
        check_recurrent_call(model, hf_specdec.SpecDecoder(method="ngram"), model.generation_config, {})
    except (NotImplementedError, ValueError) as error:
        # A refusal must also come from the generate entry, before any model work.
        try:
            hf_specdec.generate  # noqa: B018
            model.generate(
                **inputs,
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                custom_generate=hf_specdec.generate,
                spec_decoder=hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3),
            )
        except (NotImplementedError, ValueError) as again:
            return "refused", str(again)[:120]
        return "crashed", f"check refused ({error}) but generate did not"
    for spec in (
        hf_specdec.SpecDecoder(draft_model=model, num_speculative_tokens=3),
        hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1),
    ):
        try:
            with torch.no_grad():
                out = model.generate(
                    **inputs,
                    max_new_tokens=NEW_TOKENS,
                    do_sample=False,
                    custom_generate=hf_specdec.generate,
                    spec_decoder=spec,
                )
        except Exception as error:  # noqa: BLE001
            return "crashed", f"{spec.method}: {type(error).__name__}: {str(error)[:200]}"
        if not torch.equal(out, plain):
            return "different", f"{spec.method}: {plain.tolist()} vs {out.tolist()}"
    return "identical", ""


def run_sweep(model_types: list[str]) -> dict[str, list[tuple[str, str]]]:
    outcomes: dict[str, list[tuple[str, str]]] = {}
    for model_type in model_types:
        outcome, detail = sweep_one(model_type, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])
        outcomes.setdefault(outcome, []).append((model_type, detail))
    return outcomes


def report(outcomes: dict[str, list[tuple[str, str]]]) -> str:
    lines = [f"{name}: {len(items)}" for name, items in sorted(outcomes.items())]
    for name in ("different", "crashed", "refused"):
        lines += [f"  {name} {model_type}: {detail}" for model_type, detail in outcomes.get(name, [])]
    return "\n".join(lines)


def test_every_causal_lm_is_identical_or_refused() -> None:
    """The sweep over every causal LM class of the installed transformers (about 20 s: classes whose tiny config
    does not shrink are skipped by a meta-device count). transformers 5.24: 95 identical, 28 refused (11 of them BERT-style models loaded without
    is_decoder=True, which attend both ways), 73 skipped (5.23: 103, 17, 69 before that refusal)."""
    outcomes = run_sweep(sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES))
    text = report(outcomes)
    print("\ncausal-LM sweep:\n" + text)
    assert not outcomes.get("different") and not outcomes.get("crashed"), text
    identical = {name for name, _ in outcomes.get("identical", [])}
    refused = {name for name, _ in outcomes.get("refused", [])}
    assert {"llama", "gpt2", "gemma2", "opt", "gpt_neox"} <= identical, text
    assert {"rwkv", "mamba"} <= refused, text
    assert {"qwen3_5_text", "qwen3_next"} <= identical, text  # hybrids: recurrent states rolled back
    assert len(identical) >= 80, text


if __name__ == "__main__":  # PYTHONPATH=$PWD python tests/core/test_model_support.py [model_type ...]
    import sys
    import time

    start = time.time()
    names = sys.argv[1:] or sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    result = run_sweep(names)
    print(report(result))
    print("\n".join(f"  skipped {m}: {d}" for m, d in result.get("skipped", [])))
    print(f"{time.time() - start:.0f} s")


def test_a_subclass_forwarding_kwargs_is_accepted_as_a_draft(llama) -> None:
    """A draft that wraps a real causal LM's forward with **kwargs (as benchmarks' synthetic drafts do) is accepted."""
    from conftest import make_prompts, spec_generate
    from transformers import LlamaForCausalLM

    class Wrapped(LlamaForCausalLM):
        def forward(self, input_ids=None, **kwargs):  # noqa: ANN001, ANN003, ANN201
            return super().forward(input_ids=input_ids, **kwargs)

    draft = Wrapped(llama.config).eval()
    draft.load_state_dict(llama.state_dict())
    check_supported_cache(draft, role="draft")
    inputs = make_prompts(2, seed=3)
    expected = llama.generate(**inputs, max_new_tokens=8, do_sample=False)
    spec = hf_specdec.SpecDecoder(draft_model=draft, num_speculative_tokens=3)
    assert torch.equal(spec_generate(llama, inputs, spec, max_new_tokens=8, do_sample=False), expected)


def test_a_bidirectional_causal_lm_is_refused_and_works_as_a_decoder() -> None:
    """RoBERTa loaded without `is_decoder=True` attends both ways: refused before any model work, with the fix;
    loaded as a decoder it is greedy-identical to plain `generate`."""
    from transformers import RobertaConfig, RobertaForCausalLM

    inputs = prompts()
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1)
    calls: list[int] = []  # forwards of the refused model
    for is_decoder in (False, True):
        config = RobertaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, is_decoder=is_decoder, pad_token_id=1)  # fmt: skip
        torch.manual_seed(0)
        model = RobertaForCausalLM(config).eval()
        model.generation_config.pad_token_id = 0
        gen = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
        if not is_decoder:
            model.register_forward_pre_hook(lambda *args: calls.append(1))
            try:
                model.generate(**inputs, **gen, custom_generate=hf_specdec.generate, spec_decoder=spec)
            except ValueError as error:
                assert "is_decoder=True" in str(error) and "RobertaSelfAttention" in str(error)
            else:
                raise AssertionError("a bidirectional target was not refused")
            assert calls == []  # refused before any forward
            continue
        with torch.no_grad():
            plain = model.generate(**inputs, **gen)
            out = model.generate(**inputs, **gen, custom_generate=hf_specdec.generate, spec_decoder=spec)
        assert torch.equal(out, plain)


def test_the_capture_hint_names_the_experts_implementation_to_use(llama) -> None:
    """A refused capture's warning says what to change: "eager" experts read on the host; "grouped_mm" outside
    bfloat16 copies between host and device (torch's grouped matmul), so it points at "batched_mm"; nothing is said
    of a bf16 grouped_mm model or of a dense one."""
    from proposers.test_mtp import make_mtp_target

    from hf_specdec.model_support import capture_hint

    target, mtp = make_mtp_target("deepseek_v3")
    target.set_experts_implementation("eager")
    assert "experts_implementation='grouped_mm'" in capture_hint([target])
    target.set_experts_implementation("grouped_mm")
    hint = capture_hint([target, mtp])
    assert "DeepseekV3ForCausalLM, MtpModel" in hint and "set_experts_implementation('batched_mm')" in hint
    assert capture_hint([target.to(torch.bfloat16)]) == ""
    target.set_experts_implementation("batched_mm")
    assert capture_hint([target, llama]) == ""
