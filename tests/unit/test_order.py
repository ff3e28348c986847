"""--data-order epochs: every token of the train split once per epoch, in an order fixed by
the seed, each global batch a pure function of (seed, step)."""

import numpy as np
import pytest

from meshwise.data.dataset import TokenDataset
from meshwise.data.order import epoch_position, num_windows, permuted, window_offsets
from meshwise.data.token_files import _write_meta


@pytest.mark.parametrize("count", [1, 2, 3, 7, 16, 17, 255, 1000, 4099])
def test_the_permutation_is_a_bijection_for_any_count(count):
    assert sorted(permuted(np.arange(count), count, seed=3, epoch=2).tolist()) == list(range(count))


def test_epochs_shuffle_differently_by_seed_and_epoch():
    orders = {
        (seed, epoch): permuted(np.arange(500), 500, seed, epoch).tolist()
        for seed in (0, 1)
        for epoch in (0, 1)
    }
    assert len({tuple(order) for order in orders.values()}) == 4
    same = np.mean(np.array(orders[0, 0]) == np.array(orders[0, 1]))
    assert same < 0.02  # about 1/500 of places agree by chance


@pytest.mark.parametrize(
    "num_tokens, seq_len, batch_size", [(1000, 16, 7), (4097, 32, 8), (100, 9, 3)]
)
def test_every_token_is_an_input_and_a_target_exactly_once_per_epoch(
    num_tokens, seq_len, batch_size
):
    count = num_windows(num_tokens, seq_len)
    epochs = 3
    steps = -(-epochs * count // batch_size)  # enough steps for three epochs, batches straddling
    starts = np.concatenate(
        [
            window_offsets("epochs", step, batch_size, 5, 0, num_tokens, seq_len)
            for step in range(1, steps + 1)
        ]
    )
    covered = count * seq_len  # whole windows; the tail past them is left out
    assert num_tokens - 1 - covered < seq_len
    for epoch in range(epochs):
        inputs = np.zeros(num_tokens, dtype=int)
        targets = np.zeros(num_tokens, dtype=int)
        for start in starts[epoch * count : (epoch + 1) * count]:
            assert start + seq_len + 1 <= num_tokens  # a window ends inside the split
            inputs[start : start + seq_len] += 1
            targets[start + 1 : start + seq_len + 1] += 1
        assert (inputs[:covered] == 1).all() and (inputs[covered:] == 0).all()
        assert (targets[1 : covered + 1] == 1).all() and targets[0] == 0
    last = epoch_position(steps, batch_size, num_tokens, seq_len)  # may be into a 4th epoch
    assert (last["epoch"] - 1) * count + last["epoch_windows"] == steps * batch_size


def test_a_step_is_the_same_computed_alone_and_the_seed_fixes_the_order():
    alone = window_offsets("epochs", 37, 8, 11, 0, 5000, 16)
    assert (alone == window_offsets("epochs", 37, 8, 11, 0, 5000, 16)).all()
    assert not (alone == window_offsets("epochs", 37, 8, 12, 0, 5000, 16)).all()
    with pytest.raises(ValueError, match="1-based"):
        window_offsets("epochs", 0, 8, 11, 0, 5000, 16)


def test_the_position_in_the_metrics():
    # 62 windows per epoch: step 9 of 7 rows ends at window 63, the first of epoch 2.
    assert epoch_position(8, 7, 1000, 16) == {
        "epoch": 1,
        "epoch_windows": 56,
        "windows_per_epoch": 62,
    }
    assert epoch_position(9, 7, 1000, 16) == {
        "epoch": 2,
        "epoch_windows": 1,
        "windows_per_epoch": 62,
    }


def test_token_dataset_reads_the_train_split_in_epochs_and_validates_at_random(tmp_path):
    path = tmp_path / "t.bin"
    tokens = np.arange(3000, dtype="<u2")
    tokens.tofile(path)
    _write_meta(
        path,
        {
            "num_tokens": 3000,
            "vocab_size": 3000,
            "max_token": None,
            "source": "test",
            "dtype": "uint16",
        },
    )
    data = TokenDataset(path, seq_len=16, data_order="epochs")
    batch = data.global_batch(3, 5, seed=1)
    starts = data.window_starts(3, 5, seed=1)
    assert (starts % 16 == 0).all() and (starts + 17 <= data.num_train_tokens).all()
    assert batch[:, 0].tolist() == starts.tolist()  # token i holds the id i
    val = TokenDataset(path, seq_len=16).window_starts(2, 4, 1, "val")
    assert (data.window_starts(2, 4, 1, "val") == val).all()
