"""Your own images, without torchvision: ``root/train/<class>/*.png`` (and ``root/test/<class>/...``, optional), the
layout torchvision's ImageFolder reads. The example of ``data._target_`` (README, "Your own data"):

    python -m launcher data._target_=models.image_folder.image_folder \\
        +data.kwargs.root=/data/pets +data.kwargs.image_size=64 +data.kwargs.channels=3 \\
        data.image_size=64 data.channels=3 data.num_classes=37 data.num_workers=4

Any function returning ``(train, test)`` map-style Datasets of ``(image tensor (C, H, W), int label)`` works the
same way (``test`` may be None); the launcher checks the first sample against data.channels / data.image_size /
data.num_classes before training, and shards, shuffles and resumes it as it does its own data sets."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset

EXTENSIONS = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp"}


class ImageFolder(Dataset):
    """Images under ``root/<class>/``, labelled by the position of their class in ``classes``; read, converted
    (grey or RGB), resized and scaled to [-1, 1] when a sample is asked for (in the DataLoader's workers)."""

    def __init__(self, root: Path, classes: list[str], image_size: int, channels: int) -> None:
        if channels not in (1, 3):
            raise ValueError(f"channels={channels}: images are read as grey (1) or RGB (3)")
        self.image_size, self.mode = image_size, "L" if channels == 1 else "RGB"
        self.samples = [
            (path, label)
            for label, name in enumerate(classes)
            if (root / name).is_dir()
            for path in sorted((root / name).iterdir())
            if path.suffix.lower() in EXTENSIONS
        ]
        if not self.samples:
            raise ValueError(f"no images ({', '.join(sorted(EXTENSIONS))}) in {root}/<class>/")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        path, label = self.samples[index]
        with Image.open(path) as image:
            pixels = np.asarray(image.convert(self.mode).resize((self.image_size, self.image_size)), np.float32)
        x = torch.from_numpy(pixels / 127.5 - 1.0)
        return (x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)).contiguous(), label


def image_folder(root: str, image_size: int = 28, channels: int = 1) -> tuple[ImageFolder, Optional[ImageFolder]]:
    """(train, test) from ``root/train`` and ``root/test`` (None when absent); the classes are train's folders."""
    base = Path(root)
    if not (base / "train").is_dir():
        raise ValueError(f"{base / 'train'} is not a directory; HINT: lay the images out as root/train/<class>/*.png")
    classes = sorted(p.name for p in (base / "train").iterdir() if p.is_dir())
    test = ImageFolder(base / "test", classes, image_size, channels) if (base / "test").is_dir() else None
    return ImageFolder(base / "train", classes, image_size, channels), test
