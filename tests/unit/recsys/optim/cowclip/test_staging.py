"""What a CowClip backward hands on (recsys/optim/cowclip/staging.py): the touched/clipped counters
and their reset, MEAN pooling as per-occurrence weights, and an unpooled gradient laid out as
bags of one id."""

from __future__ import annotations

import pytest
import torch

from recsys.optim.cowclip.reference import batch_row_gradients
from recsys.optim.cowclip.staging import UpdateStats, mean_pooling_weights, unpooled_as_bags


def test_update_stats_sums_host_and_device_counts_until_taken():
    s = UpdateStats()
    s.add(3, 1)
    s.add_counts(torch.tensor([[2, 1], [4, 0]]))  # two features: (unique, clipped)
    s.add_counts(torch.tensor([[5, 2]]))
    assert s.calls == 3
    assert (s.unique_rows, s.clipped_rows) == (3 + 2 + 4 + 5, 1 + 1 + 0 + 2)
    s.add(1, 1)  # after the pending counts were read
    assert s.take() == (15, 5)
    assert (s.calls, s.unique_rows, s.clipped_rows) == (0, 0, 0)
    assert s.take() == (0, 0)


def test_update_stats_take_folds_counts_not_yet_read():
    s = UpdateStats()
    s.add_counts(torch.tensor([[7, 3]]))
    assert s.take() == (7, 3)
    assert s.take() == (0, 0)


def test_mean_pooling_weights_are_one_over_the_bag_length():
    offsets = torch.tensor([0, 2, 2, 5, 6])  # bags of 2, 0, 3 and 1 ids
    got = mean_pooling_weights(offsets, 6)
    assert got.tolist() == pytest.approx([1 / 2, 1 / 2, 1 / 3, 1 / 3, 1 / 3, 1.0])
    assert got.dtype == torch.float32
    psw = torch.tensor([2.0, 4.0, 3.0, 6.0, 9.0, 0.5])
    assert mean_pooling_weights(offsets, 6, psw).tolist() == pytest.approx([1.0, 2.0, 1.0, 2.0, 3.0, 0.5])


def test_mean_pooling_weights_make_the_row_gradient_of_a_mean_bag():
    """Bag 0 = ids (1, 2, 1), bag 1 = id (2): the mean's gradient reaches id 1 twice with 1/3 of
    bag 0's gradient, id 2 once with 1/3 of it and once with all of bag 1's."""
    idx, off = torch.tensor([1, 2, 1, 2]), torch.tensor([0, 3, 4])
    go = torch.tensor([[3.0, 6.0], [1.0, -1.0]])
    rows, grads, counts = batch_row_gradients(idx, off, go, mean_pooling_weights(off, 4))
    assert rows.tolist() == [1, 2] and counts.tolist() == [1, 2]
    torch.testing.assert_close(grads, torch.tensor([[2.0, 4.0], [1.0 + 1.0, 2.0 - 1.0]]))


def test_unpooled_as_bags_lays_each_id_out_as_its_own_bag():
    """2 features, batch 2, width 2: feature 0 has bags of 2 and 1 ids (3 ids), feature 1 of 0 and
    1 (1 id). Feature f's ids fill bags 0..n_f-1 of its column block; the rest stay empty."""
    offsets = torch.tensor([0, 2, 3, 3, 4])
    grad_out = torch.arange(8, dtype=torch.float32).view(4, 2)  # ids 0..3 in feature-major order
    bags, bag_offsets = unpooled_as_bags(grad_out, offsets, num_features=2)
    expect = torch.tensor(
        [
            [0.0, 1.0, 6.0, 7.0],  # bag 0: feature 0's id 0, feature 1's id 3
            [2.0, 3.0, 0.0, 0.0],  # bag 1: feature 0's id 1
            [4.0, 5.0, 0.0, 0.0],  # bag 2: feature 0's id 2
        ]
    )
    assert torch.equal(bags, expect)
    assert bag_offsets.tolist() == [0, 1, 2, 3, 4, 4, 4]
    assert bag_offsets.dtype == offsets.dtype


def test_unpooled_as_bags_row_gradients_are_sums_and_counts_of_occurrences():
    """The same id twice in one sample of a sequence feature: two bags of one, so its count is 2
    (occurrences) and its gradient the sum of its two rows."""
    offsets = torch.tensor([0, 3, 4])  # one feature, batch 2: ids (5, 7, 5) and (7)
    indices = torch.tensor([5, 7, 5, 7])
    grad_out = torch.tensor([[1.0, 0.0], [0.0, 1.0], [2.0, 2.0], [3.0, -1.0]])
    bags, bag_offsets = unpooled_as_bags(grad_out, offsets, num_features=1)
    assert bag_offsets.tolist() == [0, 1, 2, 3, 4]
    rows, grads, counts = batch_row_gradients(indices, bag_offsets, bags)
    assert rows.tolist() == [5, 7] and counts.tolist() == [2, 2]
    torch.testing.assert_close(grads, torch.tensor([[3.0, 2.0], [3.0, 0.0]]))
