"""One reading of ``eos_token_id`` for every runtime (run.py, the server, the engine runner, LoRA-inject, training)."""

from __future__ import annotations

import pytest

from tensorrt_llm_dflash.decode import stop_ids


@pytest.mark.parametrize("eos, want", [(None, []), (2, [2]), ([2, 7], [2, 7]), ((3,), [3]), ([], [])])
def test_eos_token_id_in_every_form_becomes_a_list_of_ints(eos, want):
    got = stop_ids(eos)
    assert got == want and all(type(t) is int for t in got)


def test_numpy_and_tensor_ids_become_plain_ints():
    import numpy as np
    import torch

    assert stop_ids(np.int64(5)) == [5] and stop_ids([torch.tensor(6)]) == [6]
