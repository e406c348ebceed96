"""hf_specdec as a transformers `custom_generate` repository: exact, batched speculative decoding.

`model.generate(**inputs, custom_generate="<this repository>", trust_remote_code=True, spec_decoder=...)` runs
`hf_specdec.generate`, the installed library's entry point (this file imports it; it holds no copy of it). Greedy
output is token-for-token identical to plain `generate`; sampling keeps the target's distribution.
"""

import hf_specdec


def generate(model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN201
    """transformers calls this with the target model and every argument of `generate` (`custom_generate` and
    `trust_remote_code` removed). It runs `generate` again with hf_specdec's decoding loop as the callable
    `custom_generate`, so transformers prepares the generation config, processors and cache as usual.
    `spec_decoder=hf_specdec.SpecDecoder(...)` chooses how to speculate; without it, prompt lookup with the
    adaptive schedule (speculation only where it pays)."""
    for name in ("streamer", "tokenizer", "stop_strings"):  # not forwarded to a callable: hf_specdec's names
        if kwargs.get(name) is not None:
            kwargs[f"spec_{name}"] = kwargs.pop(name)
        kwargs.pop(name, None)
    return model.generate(*args, custom_generate=hf_specdec.generate, **kwargs)
