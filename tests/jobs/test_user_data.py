"""A user's own data set through ``data._target_`` (here the shipped example, models/image_folder.py, on PNG files
written by the test): its shape checked against the config before training, and sharded, shuffled and trained as
the built-in sets are (2 ranks train what one process trains)."""

import numpy as np
import pytest
import torch
from PIL import Image

from harness.ranks import train_layout
from launcher.config import DataConfig
from launcher.train.data import build_datasets

CLASSES = 3


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """root/{train,test}/<class>/*.png: grey 12x12 images whose class is where the bright square is."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for split, count in (("train", 96), ("test", 24)):
        for label in range(CLASSES):
            (root / split / f"c{label}").mkdir(parents=True)
            for i in range(count // CLASSES):
                pixels = rng.integers(0, 60, (12, 12))
                pixels[4 * label : 4 * label + 4, 2:10] = 255
                Image.fromarray(pixels.astype(np.uint8)).save(root / split / f"c{label}" / f"{i}.png")
    return root


def data_args(root, size=8):
    return (
        "data._target_=models.image_folder.image_folder",
        f"+data.kwargs.root={root}",
        f"+data.kwargs.image_size={size}",
        f"data.image_size={size}",
        f"data.num_classes={CLASSES}",
        "train.batch_size=16",
    )


def test_own_data_trains_the_same_on_two_ranks_as_on_one(tmp_path, folder):
    one = train_layout(tmp_path / "one", "1x1", *data_args(folder), "train.epochs=3")
    two = train_layout(tmp_path / "two", "1x2", *data_args(folder), "train.epochs=3", "data.num_workers=1")
    summary = two[0]["summary"]
    assert summary["data"] == "models.image_folder.image_folder", summary
    assert summary["steps"] == 3 * 96 // 16 and summary["test_accuracy"] > 0.9, summary
    for name, value in two[0]["params"].items():
        torch.testing.assert_close(value, one[0]["params"][name], rtol=1e-4, atol=1e-5)


def test_a_shape_that_differs_from_the_config_is_named_before_training(folder):
    cfg = DataConfig(_target_="models.image_folder.image_folder", kwargs={"root": str(folder), "image_size": 8})
    with pytest.raises(ValueError) as err:  # data.image_size stays 28
        build_datasets(cfg)
    assert str(err.value) == (
        "data._target_='models.image_folder.image_folder': the first train sample has shape (1, 8, 8), but "
        "data.channels=1 data.image_size=28 describe (1, 28, 28) to the model; HINT: data.channels=1 data.image_size=8"
    )
    cfg = DataConfig(_target_="models.image_folder.image_folder", kwargs={"root": str(folder)}, num_classes=2)
    with pytest.raises(ValueError, match=r"train sample 95 has label 2, outside \[0, data.num_classes=2\)"):
        build_datasets(cfg)
