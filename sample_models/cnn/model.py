"""Sample model ``cnn``: a small convolutional image classifier.

Architecture:
    features.conv1  Conv2d(3->16, 3x3, pad 1) -> features.bn1 BatchNorm2d(16) -> ReLU -> MaxPool2d(2)
    features.conv2  Conv2d(16->32, 3x3, pad 1) -> features.bn2 BatchNorm2d(32) -> ReLU
    pool            AdaptiveAvgPool2d(1) -> Flatten
    head            Linear(32->10)

Batch: ``(images, labels)`` with images float32 [8, 3, 16, 16] and labels int64 [8] in [0, 10).
No ``loss_fn``: the tool infers cross-entropy from ``(inputs, target)``.

What the audit should find: convolutions and the Linear head run fine in FP16/BF16 (small errors, no
overflow). BatchNorm is a reduction: its kernels accumulate the batch statistics in FP32 and its
weights/running stats stay FP32, so its error should stay small even with a half-precision input.
Alignment: conv1 has only 3 input channels (not a multiple of 8) --
expected for an RGB stem and normally left alone -- and the head's 10 outputs are not a multiple of 8
(suggest 16). No overflow and no significant gradient underflow at the recommended loss scale.
Note: the model is audited in train mode, so BatchNorm uses batch statistics and updates its
running buffers.
"""
import torch
import torch.nn as nn

NUM_CLASSES = 10
BATCH_SIZE = 8
IMAGE_SIZE = 16
SEED = 0


class SmallCNN(nn.Module):
    def __init__(self, num_classes=NUM_CLASSES):
        super().__init__()
        self.features = nn.Sequential()
        self.features.add_module("conv1", nn.Conv2d(3, 16, kernel_size=3, padding=1))
        self.features.add_module("bn1", nn.BatchNorm2d(16))
        self.features.add_module("relu1", nn.ReLU())
        self.features.add_module("pool1", nn.MaxPool2d(2))
        self.features.add_module("conv2", nn.Conv2d(16, 32, kernel_size=3, padding=1))
        self.features.add_module("bn2", nn.BatchNorm2d(32))
        self.features.add_module("relu2", nn.ReLU())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.head = nn.Linear(32, num_classes)

    def forward(self, x):
        return self.head(self.flatten(self.pool(self.features(x))))


def build_model():
    """A freshly initialised SmallCNN; the seed is fixed so every call gives identical weights."""
    torch.manual_seed(SEED)
    return SmallCNN()


def sample_batch():
    """Deterministic ``(images [8, 3, 16, 16] float32, labels [8] int64)``."""
    g = torch.Generator().manual_seed(1234)
    images = torch.randn(BATCH_SIZE, 3, IMAGE_SIZE, IMAGE_SIZE, generator=g)
    labels = torch.randint(0, NUM_CLASSES, (BATCH_SIZE,), generator=g)
    return (images, labels)
