"""The data the diagnosis examples name as ``data.py:make_loader`` (see diagnose.py).

Random images and labels from a Dataset that takes a little time per image, as decoding does.
"""

import time

import torch
from torch.utils.data import DataLoader, Dataset


class SlowImages(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(0.002)  # decoding an image
        return torch.randn(3, 32, 32), torch.tensor(index % 10)


def make_loader() -> DataLoader:
    return DataLoader(SlowImages(), batch_size=8)


if __name__ == "__main__":
    images, labels = next(iter(make_loader()))
    print(images.shape, labels.shape)
