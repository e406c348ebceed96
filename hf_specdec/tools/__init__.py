"""Tools built on the library, not part of it: the `hf-specdec` console script, the demo, benchmarks, prompts and
model loading (the offline SmolLM2 GGUF, tiny random models). The library (`hf_specdec`) never imports from here.
"""
