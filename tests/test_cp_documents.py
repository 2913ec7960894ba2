"""Context-parallel work under a document mask: each rank's unmasked score pairs, counted by
engine.cp.documents, equal a brute-force count over the mask itself."""

import pytest
import torch

from engine.cp.documents import (document_imbalance, document_mask, document_starts,
                                 rank_document_pairs)
from engine.cp.layout import shard_indices


def test_mask_is_block_diagonal_causal():
    mask = document_mask([2, 3])
    expected = torch.tensor([[1, 0, 0, 0, 0],
                             [1, 1, 0, 0, 0],
                             [0, 0, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 1, 1, 1]], dtype=torch.bool)
    assert torch.equal(mask, expected)
    assert document_starts([2, 3]).tolist() == [0, 0, 2, 2, 2]


@pytest.mark.parametrize("lengths", [[16], [5, 3, 8], [1, 1, 14], [4] * 4, [12, 4]])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("n", [2, 4])
def test_rank_pairs_equal_brute_force_over_the_mask(lengths, layout, n):
    mask = document_mask(lengths)
    brute = [int(mask[shard_indices(sum(lengths), n, rank, layout)].sum()) for rank in range(n)]
    assert rank_document_pairs(lengths, n, layout) == brute
    assert sum(brute) == int(mask.sum())


@pytest.mark.parametrize("lengths", [[16], [8, 8], [4, 12], [4, 4, 8]])
def test_per_document_zigzag_equals_brute_force(lengths):
    n = 2
    mask = document_mask(lengths)
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    brute = []
    for rank in range(n):
        rows = torch.cat([start + shard_indices(length, n, rank, "zigzag")
                          for start, length in zip(starts, lengths)])
        brute.append(int(mask[rows].sum()))
    assert rank_document_pairs(lengths, n, "per-document") == brute
    assert brute[0] == brute[1]  # each document balanced on its own


def test_hand_counted_contiguous():
    # one document of 8 on 2 ranks: rank 0 queries 0..3 see 1+2+3+4 keys, rank 1 5+6+7+8
    assert rank_document_pairs([8], 2, "contiguous") == [10, 26]
    # two documents of 4: the same 1+2+3+4 on each rank
    assert rank_document_pairs([4, 4], 2, "contiguous") == [10, 10]


def test_zigzag_loses_balance_on_a_mix_of_documents():
    one, mixed = [8192], [4096, 1024, 512, 512] + [256] * 8
    assert document_imbalance(one, 4)["zigzag"] == 1.0
    ratio = document_imbalance(mixed, 4)
    assert ratio["zigzag"] > 1.7 and ratio["contiguous"] > 2.6
    assert ratio["per-document"] == 1.0


def test_bad_documents_named():
    with pytest.raises(ValueError, match="positive token counts"):
        rank_document_pairs([4, 0], 2, "zigzag")
