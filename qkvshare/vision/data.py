"""Image-classification data for `qkvshare vision`: scikit-learn's digits, any Hugging Face image dataset, a folder.

Sources (`--dataset`)
- ``digits`` (default): scikit-learn's bundled 1,797 8x8 grey digits (values 0-16), offline. A fixed split
  (seed 0, 20% test: 1,437 / 360) shared by every seed, so seeds differ only in initialization and shuffling.
- a Hugging Face dataset name (``mnist``, ``fashion_mnist``, ``cifar10``, ``cifar100``, ``zh-plus/tiny-imagenet``,
  ...) through `datasets.load_dataset`, or a directory written by `save_to_disk`, or ``imagefolder`` with
  ``--data_dir`` (one sub-folder per class). The image column is the one with an `Image` feature and the label
  column the `ClassLabel` one (or ``label``/``labels``/``fine_label``) unless `--image_column`/`--label_column`
  name them. Test split: ``test``, else ``validation``/``valid``/``val``, else 20% of ``train`` (seed 0).

Every image goes through one `ViTImageProcessor` (RGB, resized to `image_size`, scaled to [-1, 1] with mean and
std 0.5), the same one saved next to each model, so `pipeline("image-classification")` on a saved model sees the
inputs it was trained on. Images are converted to RGB as that pipeline does (`load_image`), grey ones included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import ViTImageProcessor

from qkvshare_settings.extras import require

TEST_SPLITS = ("test", "validation", "valid", "val")
LABEL_COLUMNS = ("label", "labels", "fine_label", "coarse_label")
TEST_FRACTION = 0.2


@dataclass
class ImageSplits:
    """The images of a dataset as PIL images (RGB), integer labels (N,), and the class names."""

    train_images: list
    train_y: torch.Tensor
    test_images: list
    test_y: torch.Tensor
    class_names: list[str]

    @property
    def native_size(self) -> int:
        """The side of the (first) image; a ValueError if it is not square."""
        width, height = self.train_images[0].size
        if width != height:
            raise ValueError(f"the images are {width}x{height}, not square; pass --image_size to resize them.")
        return width

    def pixel_values(self, image_size: int) -> dict[str, torch.Tensor]:
        """train_x / test_x (N, 3, S, S) through `image_processor(image_size)`, with train_y / test_y."""
        processor = image_processor(image_size)
        return {
            "train_x": processor(self.train_images, return_tensors="pt")["pixel_values"],
            "train_y": self.train_y,
            "test_x": processor(self.test_images, return_tensors="pt")["pixel_values"],
            "test_y": self.test_y,
        }


def image_processor(image_size: int):
    """The preprocessing of every image: transformers' ViTImageProcessor (saved with each model)."""
    return ViTImageProcessor(
        do_resize=True, size={"height": image_size, "width": image_size}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )


def default_patch_size(image_size: int) -> int:
    """The smallest patch of at least 2 px that cuts `image_size` into at most 8 x 8 patches (8 px -> 2, 28 -> 4,
    32 -> 4, 64 -> 8); the image itself if no such patch exists."""
    sizes = [p for p in range(2, image_size + 1) if image_size % p == 0 and image_size // p <= 8]
    return sizes[0] if sizes else image_size


def _split(n: int, fraction: float = TEST_FRACTION, seed: int = 0) -> tuple[list[int], list[int]]:
    """A fixed (train, test) split of range(n): the test part is `fraction` of a seeded permutation."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    cut = math.ceil(n * fraction)
    return order[cut:], order[:cut]


def _subset(indices: list[int], limit: int | None) -> list[int]:
    return indices if limit is None else indices[:limit]


def load_digits(max_train: int | None, max_test: int | None) -> ImageSplits:
    """scikit-learn's digits (grey 0-16 -> 8-bit RGB images)."""
    from PIL import Image

    datasets = require("sklearn.datasets", "vision", "qkvshare vision (the digits dataset)")
    digits = datasets.load_digits()
    pixels = np.rint(digits.images * (255 / 16)).astype("uint8")  # (1797, 8, 8)
    images = [Image.fromarray(p, mode="L").convert("RGB") for p in pixels]
    y = torch.as_tensor(digits.target, dtype=torch.long)
    train, test = _split(len(images))
    train, test = _subset(train, max_train), _subset(test, max_test)
    names = [str(c) for c in digits.target_names]
    return ImageSplits([images[i] for i in train], y[train], [images[i] for i in test], y[test], names)


def _columns(features: Any, image_column: str | None, label_column: str | None, source: str) -> tuple[str, str]:
    """The image and label columns of a dataset: given, or detected from the features."""
    from datasets import ClassLabel, Image

    names = list(features)
    if image_column is None:
        image_column = next((n for n in names if isinstance(features[n], Image)), None)
    if label_column is None:
        label_column = next((n for n in names if isinstance(features[n], ClassLabel)), None)
        label_column = label_column or next((n for n in LABEL_COLUMNS if n in names), None)
    for flag, column in (("--image_column", image_column), ("--label_column", label_column)):
        if column is None or column not in names:
            found = "none detected" if column is None else f"{column!r} is not a column"
            raise ValueError(f"{source}: {flag}: {found}; the columns are {', '.join(names)}. Name it with {flag}.")
    return image_column, label_column


def load_hf(
    name: str,
    data_dir: str | None,
    image_column: str | None,
    label_column: str | None,
    max_train: int | None,
    max_test: int | None,
) -> ImageSplits:
    """A Hugging Face image-classification dataset (hub name, `save_to_disk` directory or `imagefolder`)."""
    datasets = require("datasets", "vision", f"qkvshare vision --dataset {name}")
    source = f"--dataset {name}"
    try:
        loaded = (
            datasets.load_from_disk(name) if Path(name).is_dir() else datasets.load_dataset(name, data_dir=data_dir)
        )
    except Exception as err:  # the datasets error names the real problem; add what to do about it
        raise ValueError(
            f"{source}: could not load it ({type(err).__name__}: {err}); give a Hugging Face dataset name (with network "
            "access), a save_to_disk folder, or imagefolder with --data_dir."
        ) from err
    if isinstance(loaded, datasets.Dataset):
        loaded = datasets.DatasetDict({"train": loaded})
    if "train" not in loaded:
        raise ValueError(f"{source}: no 'train' split; the splits are {', '.join(loaded)}.")
    train_set = loaded["train"]
    test_name = next((s for s in TEST_SPLITS if s in loaded), None)
    image_column, label_column = _columns(train_set.features, image_column, label_column, source)
    if test_name is None:
        train_index, test_index = _split(len(train_set))
        test_set = train_set
    else:
        test_set = loaded[test_name]
        train_index, test_index = list(range(len(train_set))), list(range(len(test_set)))
    train_index, test_index = _subset(train_index, max_train), _subset(test_index, max_test)
    feature = train_set.features[label_column]
    class_names = list(feature.names) if hasattr(feature, "names") else None

    def take(dataset, index: list[int]) -> tuple[list, torch.Tensor]:
        rows = dataset.select(index)
        images = [image.convert("RGB") for image in rows[image_column]]
        return images, torch.as_tensor(rows[label_column], dtype=torch.long)

    train_images, train_y = take(train_set, train_index)
    test_images, test_y = take(test_set, test_index)
    if not train_images or not test_images:
        raise ValueError(f"{source}: the train or test split is empty; check --max_train/--max_test.")
    if class_names is None:
        class_names = [str(c) for c in range(int(max(train_y.max(), test_y.max())) + 1)]
    return ImageSplits(train_images, train_y, test_images, test_y, class_names)


def load_images(
    dataset: str,
    data_dir: str | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
    max_train: int | None = None,
    max_test: int | None = None,
) -> ImageSplits:
    """The images of `dataset` (see the module docstring), as RGB PIL images."""
    if dataset == "digits":
        return load_digits(max_train, max_test)
    return load_hf(dataset, data_dir, image_column, label_column, max_train, max_test)


__all__ = ["ImageSplits", "load_images", "image_processor", "default_patch_size"]
