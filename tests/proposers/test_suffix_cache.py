"""Tests of `SuffixCache`, the global tree a `SpecDecoder` keeps: bounds, oldest-first eviction, threads, settings.

Past `max_requests` outputs or `max_tokens` tokens the oldest outputs leave and the tree equals one built from the
rest; 0 turns the cache off; an output longer than the bound keeps its last tokens; threads adding and drafting at
once leave the tree exactly what the same adds in one thread make; `cache_for` keeps one cache per `SpecDecoder`
and makes a new one when its suffix settings change.
"""

from __future__ import annotations

import threading

import numpy as np

import hf_specdec
from hf_specdec.proposers.suffix_cache import SuffixCache, cache_for
from hf_specdec.proposers.suffix_search import suffix_drafts
from hf_specdec.proposers.suffix_tree import SuffixTree


def outputs(n: int, length: int = 12, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, 20, length) for _ in range(n)]


def same_tree(a: SuffixTree, b: SuffixTree, strings: list[list[int]]) -> bool:
    return a.num_nodes == b.num_nodes and all(a.counts(s) == b.counts(s) for s in strings)


def test_requests_bound_evicts_the_oldest():
    cache = SuffixCache(max_depth=4, max_requests=3, max_tokens=10**6)
    outs = outputs(5)
    for out in outs:
        cache.add(out)
    assert cache.num_requests == 3 and cache.num_evicted == 2 and cache.num_tokens == 36
    fresh = SuffixTree(4)
    for out in outs[2:]:
        fresh.add(out)
    strings = [out[p : p + n].tolist() for out in outs for p in range(10) for n in (1, 2, 3)]
    assert same_tree(cache.tree, fresh, strings)


def test_tokens_bound_and_a_long_output_keeps_its_end():
    cache = SuffixCache(max_depth=4, max_requests=100, max_tokens=30)
    for out in outputs(4):
        cache.add(out)
    assert cache.num_tokens <= 30 and cache.num_requests == 2
    long = np.arange(100, 150)
    cache.add(long)
    assert cache.num_requests == 1 and cache.num_tokens == 30
    assert cache.tree.counts([149]) == (1, 0) and cache.tree.counts([119]) == (0, 0)


def test_zero_turns_the_global_tree_off():
    for bounds in ((0, 100), (100, 0)):
        cache = SuffixCache(4, *bounds)
        cache.add(np.arange(10))
        assert not cache.enabled and cache.num_requests == 0 and cache.tree.num_nodes == 1


def test_threads_adding_and_drafting_at_once():
    """Eight threads add outputs while others draft from the cache under its lock: no error, and the tree ends
    exactly as the same outputs added in one thread leave it (the bound is large enough to keep them all)."""
    cache = SuffixCache(max_depth=6, max_requests=1000, max_tokens=10**6)
    outs = outputs(64, length=40, seed=3)
    errors: list[BaseException] = []

    def add(chunk: list[np.ndarray]) -> None:
        try:
            for out in chunk:
                cache.add(out)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            errors.append(error)

    def drafter() -> None:
        local = SuffixTree(6)
        active, state = local.start_rows(local.roots)
        row = outs[0][None, :20].astype(np.int64)
        local.append_rows(active, state, row, np.array([20]))
        try:
            for _ in range(200):
                with cache.lock:
                    suffix_drafts(local, active, state, row, cache.tree, np.array([8]), 8, 1.0, 0.1)
        except BaseException as error:  # noqa: BLE001
            errors.append(error)

    threads = [threading.Thread(target=add, args=(outs[i::8],)) for i in range(8)]
    threads += [threading.Thread(target=drafter) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    fresh = SuffixTree(6)
    for out in outs:
        fresh.add(out)
    strings = [out[p : p + n].tolist() for out in outs for p in range(0, 30, 3) for n in (1, 3, 6)]
    assert cache.num_requests == 64 and same_tree(cache.tree, fresh, strings)


def test_cache_for_keeps_one_cache_per_spec_decoder_and_remakes_it_on_new_settings():
    spec = hf_specdec.SpecDecoder(method="suffix", suffix_max_cached_requests=5)
    cache = cache_for(spec)
    assert cache is cache_for(spec) and cache.max_requests == 5 and spec.suffix_cache is cache
    cache.add(np.arange(10))
    spec.suffix_max_tree_depth = 8
    remade = cache_for(spec)
    assert remade is not cache and remade.max_depth == 8 and remade.num_requests == 0
    assert "suffix_cache" not in spec.to_dict()
    assert hf_specdec.SpecDecoder.from_dict(spec.to_dict()).suffix_cache is None
