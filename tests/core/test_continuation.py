"""Continuing from a filled `past_key_values`: a chat loop that keeps its cache, speculative vs plain `generate`.

Each turn passes the whole conversation so far plus the cache the previous turn filled; the speculative turn must
produce plain's tokens and leave the cache plain leaves (one column per token but the last, EOS and padding of rows
that finished early included, sliding layers cut to their window), in the caller's cache object.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import make_model, make_noisy_copy, make_prompts, spec_generate
from transformers import DynamicCache

import hf_specdec

MAX_NEW = 10


def turns(batch_size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 96, (batch_size, n), generator=g) for n in (4, 3)]


def chat(model, first: dict, later: list[torch.Tensor], cache: DynamicCache, run, eos: int | None) -> list:
    """Three turns; turn t > 0 feeds the previous output plus the new tokens and continues `cache`."""
    outputs = []
    input_ids, mask = first["input_ids"], first["attention_mask"]
    for t in range(3):
        if t:
            previous = outputs[-1].sequences
            grown = previous.shape[1] - mask.shape[1]
            new = later[t - 1]
            input_ids = torch.cat([previous, new], 1)
            mask = torch.cat([mask, torch.ones(mask.shape[0], grown + new.shape[1], dtype=mask.dtype)], 1)
        out = run(model, {"input_ids": input_ids, "attention_mask": mask}, cache, eos)
        assert out.past_key_values is cache, "the caller's cache object is filled in place, like plain generate"
        out.past_key_values = copy.deepcopy(cache)  # this turn's content (the next turn goes on filling `cache`)
        outputs.append(out)
    return outputs


def plain(model, inputs, cache, eos):
    return model.generate(
        **inputs,
        past_key_values=cache,
        max_new_tokens=MAX_NEW,
        do_sample=False,
        eos_token_id=eos,
        return_dict_in_generate=True,
    )


def speculative(spec):
    def run(model, inputs, cache, eos):
        return spec_generate(
            model,
            inputs,
            spec,
            past_key_values=cache,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=eos,
            return_dict_in_generate=True,
        )

    return run


def assert_same_cache(ours: DynamicCache, theirs: DynamicCache, attention_mask: torch.Tensor) -> None:
    assert len(ours.layers) == len(theirs.layers)
    assert ours.get_seq_length() == theirs.get_seq_length()
    for a, b in zip(ours.layers, theirs.layers):
        assert type(a) is type(b)
        assert a.keys.shape == b.keys.shape
        real = attention_mask[:, -a.keys.shape[2] :].bool()[:, None, :, None]  # padding columns hold anything
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            assert torch.allclose(torch.where(real, x, 0), torch.where(real, y, 0), rtol=1e-4, atol=1e-4)


def early_eos(model, inputs) -> int:
    """A token the last row generates mid-way: as EOS, that row finishes early and the others pad or go on."""
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    return int(out[-1, inputs["input_ids"].shape[1] + 3])


@pytest.mark.parametrize("arch", ["llama", "mistral"])
@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("method", ["draft", "ngram", "early_exit"])
def test_three_turn_chat_continues_the_cache_like_plain(arch, batch_size, method):
    target = make_model(arch, seed=0)
    first = make_prompts(batch_size, seed=batch_size, max_len=9)
    later = turns(batch_size, seed=batch_size)
    eos = early_eos(target, first) if batch_size > 1 else 2
    spec = {
        "draft": lambda: hf_specdec.SpecDecoder(draft_model=make_noisy_copy(target, 0.05), num_speculative_tokens=3),
        "ngram": lambda: hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3, prompt_lookup_max=2),
        "early_exit": lambda: hf_specdec.SpecDecoder(early_exit_layers=1, num_speculative_tokens=3),
    }[method]()
    config = target.config.get_text_config(decoder=True)
    expected = chat(target, first, later, DynamicCache(config=config), plain, eos)
    got = chat(target, first, later, DynamicCache(config=config), speculative(spec), eos)
    for t, (ours, theirs) in enumerate(zip(got, expected)):
        assert torch.equal(ours.sequences, theirs.sequences), f"turn {t}: {ours.sequences} != {theirs.sequences}"
        width = ours.sequences.shape[1] - 1
        mask = (torch.arange(width) >= (first["attention_mask"] == 0).sum(1)[:, None]).long()
        assert_same_cache(ours.past_key_values, theirs.past_key_values, mask)


def test_speculation_continues_plain_generates_cache(llama, llama_draft):
    """Turn 2 speculates from the cache that plain turn 1 filled, and equals plain turn 2 on a copy of it."""
    first = make_prompts(3, seed=4, max_len=8)
    cache = DynamicCache(config=llama.config)
    out = plain(llama, first, cache, None)
    new = turns(3, seed=5)[0]
    inputs = {
        "input_ids": torch.cat([out.sequences, new], 1),
        "attention_mask": torch.cat(
            [first["attention_mask"], torch.ones(3, MAX_NEW + new.shape[1], dtype=torch.long)], 1
        ),
    }
    expected = plain(llama, inputs, copy.deepcopy(cache), None)
    spec = hf_specdec.SpecDecoder(draft_model=llama_draft, num_speculative_tokens=4)
    got = speculative(spec)(llama, inputs, cache, None)
    assert torch.equal(got.sequences, expected.sequences)


def test_routed_assisted_call_continuing_a_cache_equals_plain(llama, llama_draft):
    """`assistant_model=` + `past_key_values=` after install() equals plain generate continuing the same cache.

    (transformers 5.23's own assisted decoding and prompt lookup do not: continuing a filled cache they return
    other tokens than plain decoding here, while without the cache they agree; so stock is not the reference.)
    """
    first = make_prompts(1, seed=8)
    cache = DynamicCache(config=llama.config)
    out = plain(llama, first, cache, None)
    new = turns(1, seed=8)[0]
    inputs = {"input_ids": torch.cat([out.sequences, new], 1)}
    expected = plain(llama, inputs, copy.deepcopy(cache), None).sequences
    hf_specdec.install()
    try:
        routed = llama.generate(
            **inputs,
            past_key_values=cache,
            assistant_model=llama_draft,
            max_new_tokens=MAX_NEW,
            do_sample=False,
            eos_token_id=None,
        )
    finally:
        hf_specdec.uninstall()
    assert torch.equal(routed, expected)
    assert cache.get_seq_length() == expected.shape[1] - 1


def test_plain_output_carries_the_cache(llama):
    inputs = make_prompts(3, seed=6)
    expected = llama.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True)
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3)
    got = spec_generate(llama, inputs, spec, max_new_tokens=MAX_NEW, do_sample=False, return_dict_in_generate=True)
    assert torch.equal(got.sequences, expected.sequences)
    width = got.sequences.shape[1] - 1
    mask = (torch.arange(width) >= (inputs["attention_mask"] == 0).sum(1)[:, None]).long()
    assert_same_cache(got.past_key_values, expected.past_key_values, mask)


def test_bad_continuations_are_refused_before_any_model_work(llama):
    inputs = make_prompts(2, seed=7)
    spec = hf_specdec.SpecDecoder(method="ngram")
    cache = DynamicCache(config=llama.config)
    plain(llama, inputs, cache, None)
    with pytest.raises(ValueError, match="holds 2 rows but input_ids has 1"):
        spec_generate(
            llama, {"input_ids": torch.ones(1, 40, dtype=torch.long)}, spec, past_key_values=cache, max_new_tokens=2
        )
    with pytest.raises(ValueError, match="pass the whole conversation"):
        short = {k: v[:, :3] for k, v in inputs.items()}
        spec_generate(llama, short, spec, past_key_values=cache, max_new_tokens=2)


def test_a_cache_nobody_reads_is_not_filled_but_a_callers_is(llama, monkeypatch):
    """generate makes a cache of its own when the caller passes none; without return_dict_in_generate nobody sees
    it, so it is not filled (feeding early rows' padding took 5% of a call at batch 4). A cache the caller passes
    (transformers marks it) is filled like plain's, returned or not."""
    from hf_specdec import continuation

    handed_back = []
    hand_back = continuation.CacheHandoff.hand_back
    monkeypatch.setattr(continuation.CacheHandoff, "hand_back",
                        lambda self, *a: handed_back.append(1) or hand_back(self, *a))  # fmt: skip
    inputs = make_prompts(3, seed=8)
    settings = dict(max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None)
    expected = llama.generate(**inputs, **settings)
    spec = hf_specdec.SpecDecoder(method="ngram", num_speculative_tokens=3)
    assert torch.equal(spec_generate(llama, inputs, spec, **settings), expected)
    assert handed_back == []
    theirs, ours = DynamicCache(), DynamicCache()
    llama.generate(**inputs, **settings, past_key_values=theirs)
    assert torch.equal(spec_generate(llama, inputs, spec, **settings, past_key_values=ours), expected)
    assert handed_back == [1]
    mask = (torch.arange(expected.shape[1] - 1) >= (inputs["attention_mask"] == 0).sum(1)[:, None]).long()
    assert_same_cache(ours, theirs, mask)
