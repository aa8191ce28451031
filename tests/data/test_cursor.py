"""The data cursor: every item once per epoch, a seed's order its own, resumable."""

from __future__ import annotations

from tether.data.cursor import DataCursor


def test_every_item_is_seen_once_per_epoch_and_state_resumes_exactly():
    cursor = DataCursor(list(range(10)), seed=4)
    first = cursor.take(25)
    assert sorted(first[:10]) == sorted(first[10:20]) == list(range(10)) and first[:10] != first[10:20]
    resumed = DataCursor(list(range(10)), seed=0)
    resumed.load_state_dict(cursor.state_dict())
    assert resumed.take(12) == cursor.take(12)


def test_neighbouring_seeds_do_not_share_epochs():
    """A seed sweep's runs see independent orders: seed s + 1's epochs are not seed s's, shifted."""
    orders = {seed: DataCursor(list(range(10)), seed=seed).take(30) for seed in range(4)}
    epochs = [tuple(order[i:i + 10]) for order in orders.values() for i in (0, 10, 20)]
    assert len(set(epochs)) == len(epochs)
