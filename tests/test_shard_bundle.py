"""Reassembling a sharded parameter from hand-made shards (no processes):
FSDP1's flat slices, DTensor blocks (Shard and Replicate, uneven and empty
shards), and every refusal in one line."""
from __future__ import annotations

import math

import pytest
import torch

from amp_postmortem.errors import BundleError
from amp_postmortem.reading.shard_bundle import reassemble

WHOLE = torch.arange(15, dtype=torch.float32).reshape(5, 3)


def flat(start, numel):
    return {"kind": "flat", "global_shape": [5, 3], "flat_offset": start, "numel": numel}


def block(offset):
    return {"kind": "dtensor", "global_shape": [5, 3], "global_offset": offset, "placements": ["Shard(0)"],
            "mesh_shape": [2]}


def test_fsdp1_flat_slices_make_the_whole_tensor_also_with_an_empty_shard():
    v = WHOLE.reshape(-1)
    pieces = [(0, v[:7].clone(), flat(0, 7)), (1, v[7:].clone(), flat(7, 8)), (2, v[:0].clone(), flat(0, 0))]
    assert torch.equal(reassemble("w", pieces, 3), WHOLE)


def test_dtensor_blocks_uneven_rows_columns_and_an_empty_shard():
    rows = [(0, WHOLE[:3].clone(), block([0, 0])), (1, WHOLE[3:].clone(), block([3, 0]))]
    assert torch.equal(reassemble("w", rows, 0), WHOLE)
    cols = [(0, WHOLE[:, :2].clone(), block([0, 0])), (1, WHOLE[:, 2:].clone(), block([0, 2]))]
    assert torch.equal(reassemble("w", cols, 0), WHOLE)
    one = {"kind": "dtensor", "global_shape": [1], "global_offset": [1]}
    gain = [(0, torch.tensor([2.5]), dict(one, global_offset=[0])), (1, torch.empty(0), one)]
    assert torch.equal(reassemble("gain", gain, 0), torch.tensor([2.5]))


def test_replicated_copies_overlap_and_must_agree_bit_for_bit():
    nan = WHOLE.clone()
    nan[1, 1] = math.nan
    same = [(0, nan.clone(), block([0, 0])), (1, nan.clone(), block([0, 0]))]
    assert reassemble("w", same, 0).isnan().sum() == 1  # NaN equals NaN here
    other = nan.clone()
    other[0, 0] = -1.0
    with pytest.raises(BundleError, match=r"step 4: parameter 'w', rank 1: its shard overlaps another rank's "
                                          r"with different values"):
        reassemble("w", [(0, nan, block([0, 0])), (1, other, block([0, 0]))], 4)


@pytest.mark.parametrize("pieces, message", [
    ([(0, WHOLE[:3].clone(), block([0, 0]))], r"6 of its 15 elements are in no rank's shard \(shards from ranks 0\)"),
    ([(0, WHOLE[:3].clone(), block([0, 0])), (1, WHOLE[3:].double(), block([3, 0]))],
     r"the ranks' shards disagree on its global shape or dtype \(rank 0: \[5, 3\] torch.float32; rank 1"),
    ([(0, WHOLE[:3].clone(), block([3, 0]))], r"rank 0: its shard of shape \[3, 3\] at offset \[3, 0\] does not fit"),
    ([(0, WHOLE.reshape(-1)[:4].clone(), flat(12, 4))], r"rank 0: its 4 values at flat offset 12 do not fit"),
    ([(0, WHOLE.clone(), {"kind": "strided", "global_shape": [5, 3]})], r"placement 'strided' is not one of flat, dtensor"),
])
def test_what_cannot_be_reassembled_is_refused_in_one_line(pieces, message):
    with pytest.raises(BundleError, match=message) as e:
        reassemble("w", pieces, 2)
    assert str(e.value).startswith("step 2: parameter 'w'") and "\n" not in str(e.value)
