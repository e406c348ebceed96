"""`hf_specdec.graph_reuse`: a later call adopts a finished call's state tensors (the addresses its graphs read).

Replaying a kept CUDA graph needs a GPU (tests/core/test_captured_threads.py and the H100 benchmark check outputs);
these check, on real hf_specdec objects, what adoption copies and rebinds, when it refuses, and who may use an entry."""

from __future__ import annotations

import torch

from hf_specdec import graph_reuse
from hf_specdec.batch import RaggedBatch
from hf_specdec.metrics import SpecDecodeStats


def _state(prompt: list[list[int]]) -> SpecDecodeStats:
    root = SpecDecodeStats()
    root.batch = RaggedBatch.from_prompts(torch.tensor(prompt), None, 8)
    root.scratch = None  # a tensor the step writes before it reads (set lazily)
    return root


def test_adopt_copies_the_new_call_into_the_kept_tensors_and_points_its_attributes_there():
    old = _state([[1, 2, 3]])
    old.scratch = torch.zeros(2)
    kept_ids = old.batch.token_ids
    entry = graph_reuse.Entry(signature="s", root=old)
    new = _state([[4, 5, 6]])
    assert graph_reuse.adopt(entry, new)
    assert new.batch.token_ids is kept_ids and kept_ids[0, :3].tolist() == [4, 5, 6]  # the new prompt, old address
    assert new.batch.lengths is old.batch.lengths
    assert new.scratch is old.scratch  # lazily set in the new call: takes the kept tensor


def test_adopt_refuses_other_shapes_and_changes_nothing():
    old = _state([[1, 2, 3]])
    entry = graph_reuse.Entry(signature="s", root=old)
    new = _state([[4, 5, 6], [7, 8, 9]])  # another batch size
    ids = new.batch.token_ids
    assert not graph_reuse.adopt(entry, new)
    assert new.batch.token_ids is ids and old.batch.token_ids[0, :3].tolist() == [1, 2, 3]


def test_an_entry_serves_one_call_at_a_time_and_only_its_signature():
    class Model:
        pass

    model = Model()
    entry = graph_reuse.Entry(signature=("B", 1), root=_state([[1]]))
    graph_reuse.keep(model, entry)
    assert graph_reuse.checkout(model, ("B", 2)) is None
    assert graph_reuse.checkout(model, ("B", 1)) is entry
    assert graph_reuse.checkout(model, ("B", 1)) is None  # in use by the first caller
    graph_reuse.keep(model, entry)  # released
    assert graph_reuse.checkout(model, ("B", 1)) is entry
    for i in range(graph_reuse.MAX_ENTRIES + 2):
        graph_reuse.keep(model, graph_reuse.Entry(signature=("B", 10 + i), root=_state([[1]])))
    assert len(graph_reuse._ENTRIES[model]) == graph_reuse.MAX_ENTRIES
    graph_reuse.clear(model)
    assert graph_reuse.checkout(model, ("B", 10 + graph_reuse.MAX_ENTRIES + 1)) is None
