"""Image classification data for the MTTT experiments (`task=image`, docs/mttt.md).

Two sources, one datamodule:
- `fashion_mnist`: the IDX files of Fashion-MNIST (60,000 train / 10,000 test greyscale 28x28 images, 10
  classes) in `folder` (gzip-compressed or not). The validation split is carved from train with `split_seed`
  (the same images for every run seed); the test split is held out for the final numbers only.
- `synthetic`: an embedded, seeded set that needs no files: oriented sinusoidal gratings whose orientation is
  the class, with a random phase, frequency jitter and pixel noise.

Tokenisation (the paper's two benchmarks): an image (optionally resized to `image_size` x `image_size`,
area-averaged) is cut into non-overlapping `patch_size` x `patch_size` patches in row-major order, each
flattened to a token of p*p*C values in [-1, 1] (`value_range(-1, 1)` of the authors); patch_size = 1 gives
one token per pixel (Section 5.2). Items are {"tokens": [n, p*p*C] float32, "label": int64}.
"""

import gzip
import logging
import zlib
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ..errors import UserError
from .loaders import loader, stream_loader

log = logging.getLogger(__name__)

IDX_MAGIC = {"images": 0x00000803, "labels": 0x00000801}
FASHION_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


def read_idx(path: Path, kind: str) -> np.ndarray:
    """An IDX file (big-endian uint32 magic, one uint32 per dimension, then uint8 values), `kind` images
    ([N, rows, cols]) or labels ([N]); .gz files are decompressed. Bad files are UserErrors."""
    path = Path(path)
    try:
        raw = gzip.open(path).read() if path.suffix == ".gz" else path.read_bytes()
    except (OSError, EOFError, zlib.error) as e:  # zlib.error: a damaged .gz stream
        raise UserError(f"{path} is unreadable ({type(e).__name__}: {e}); download it again") from None
    expected = IDX_MAGIC[kind]
    if len(raw) < 4:
        raise UserError(f"{path} is truncated ({len(raw)} bytes); download it again")
    magic = int.from_bytes(raw[:4], "big")
    if magic != expected:
        raise UserError(
            f"{path} has magic number 0x{magic:08x}, not 0x{expected:08x} (IDX {kind}); is it the right file?"
        )
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise UserError(f"{path} is truncated inside its header; download it again")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    size = int(np.prod(shape))
    if len(raw) - header != size:
        raise UserError(
            f"{path} holds {len(raw) - header} values after its header, its header says "
            f"{size} ({' x '.join(map(str, shape))}): truncated or damaged; download it again"
        )
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(shape)


def find_idx(folder: Path, name: str) -> Path:
    for candidate in (folder / f"{name}.gz", folder / name):
        if candidate.is_file():
            return candidate
    raise UserError(
        f"{name}(.gz) not found in {folder}; point data.folder (or paths.data_dir) at the "
        "Fashion-MNIST IDX files, or use data=synthetic_images"
    )


def load_fashion_mnist(folder: str | Path) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """{"train": (images [60000, 28, 28] uint8, labels [60000] uint8), "test": (...)} from IDX files."""
    folder = Path(folder)
    if not folder.is_dir():
        raise UserError(
            f"Fashion-MNIST folder {folder} does not exist; set paths.data_dir (or "
            "TTT_BENCH_DATA_DIR) to the folder holding fashion-mnist/, or use data=synthetic_images"
        )
    out = {}
    for split, (images_name, labels_name) in FASHION_FILES.items():
        images = read_idx(find_idx(folder, images_name), "images")
        labels = read_idx(find_idx(folder, labels_name), "labels")
        if images.ndim != 3 or labels.ndim != 1 or len(images) != len(labels):
            raise UserError(f"{folder}: {split} images {images.shape} and labels {labels.shape} do not match")
        out[split] = (images, labels)
    return out


def synthetic_images(n: int, seed: int, split: str, size: int = 28, classes: int = 10):
    """n seeded gratings (uint8 [n, size, size], labels [n]): class c has orientation pi c / classes."""
    rng = np.random.default_rng([seed, {"train": 0, "test": 1}[split]])
    labels = rng.integers(0, classes, n)
    angle = np.pi * labels / classes + rng.normal(0, 0.05, n)
    freq = rng.uniform(0.25, 0.45, n)
    phase = rng.uniform(0, 2 * np.pi, n)
    yy, xx = np.mgrid[:size, :size].astype(np.float64)
    proj = np.cos(angle)[:, None, None] * xx + np.sin(angle)[:, None, None] * yy
    images = np.sin(freq[:, None, None] * proj + phase[:, None, None]) + rng.normal(0, 0.3, (n, size, size))
    return np.clip((images + 1.5) / 3 * 255, 0, 255).astype(np.uint8), labels.astype(np.uint8)


def check_geometry(size: int, image_size: int | None, patch_size: int) -> int:
    """The side of the (resized) image; errors when the patch does not tile it."""
    side = size if image_size is None else image_size
    if isinstance(patch_size, bool) or not isinstance(patch_size, int) or patch_size < 1:
        raise UserError(f"data.patch_size={patch_size!r} must be a positive integer (1: pixel tokens)")
    if isinstance(side, bool) or not isinstance(side, int) or side < 1:
        raise UserError(f"data.image_size={image_size!r} must be a positive integer or null (native size)")
    if side % patch_size:
        divisors = [p for p in range(1, side + 1) if side % p == 0]
        raise UserError(
            f"data.patch_size={patch_size} does not divide the {side}x{side} image; use one of "
            f"{divisors} or change data.image_size"
        )
    return side


def tokenise(images: torch.Tensor, image_size: int | None, patch_size: int) -> torch.Tensor:
    """uint8 images [B, H, W] (or [B, C, H, W]) -> tokens [B, n, p*p*C] in [-1, 1], row-major patches."""
    x = images.float() / 127.5 - 1.0
    if x.dim() == 3:
        x = x.unsqueeze(1)
    if image_size is not None and image_size != x.shape[-1]:
        x = F.interpolate(x, size=(image_size, image_size), mode="area")
    p = patch_size
    patches = F.unfold(x, kernel_size=p, stride=p)  # [B, C*p*p, n], patches in row-major order
    return patches.transpose(1, 2).contiguous()


class ImageTokens(Dataset):
    """Images and labels of one split, tokenised item by item (the images stay uint8 in memory)."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, image_size: int | None, patch_size: int):
        self.images, self.labels = (
            torch.from_numpy(np.array(images)),
            torch.from_numpy(labels.astype(np.int64)),
        )
        self.image_size, self.patch_size = image_size, patch_size

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict:
        tokens = tokenise(self.images[i : i + 1], self.image_size, self.patch_size)[0]
        return {"tokens": tokens, "label": self.labels[i]}

    def batches(self, batch_size: int):
        """Whole-split iteration without a DataLoader (evaluation): tokenised batch by batch."""
        for lo in range(0, len(self), batch_size):
            images = self.images[lo : lo + batch_size]
            yield {
                "tokens": tokenise(images, self.image_size, self.patch_size),
                "label": self.labels[lo : lo + batch_size],
            }


class ImageDataModule(L.LightningDataModule):
    """`source`: fashion_mnist (IDX files in `folder`) | synthetic. Surface used by train.py: prepare_data,
    train_dataloader (resumable, `samples_per_step` set by the trainer), val_dataloader, val_dataset,
    test_dataset, num_classes, token_dim, num_tokens, meta."""

    def __init__(
        self,
        source: str = "synthetic",
        folder: str | None = None,
        image_size: int | None = None,
        patch_size: int = 4,
        micro_batch_size: int = 64,
        train_examples: int | None = None,
        val_examples: int = 5000,
        test_examples: int | None = None,
        split_seed: int = 0,
        synthetic_train: int = 4000,
        synthetic_test: int = 1000,
        seed: int = 0,
        name: str = "images",
        num_classes: int = 10,
        native_size: int = 28,
        **_,
    ):
        super().__init__()
        if source not in ("fashion_mnist", "synthetic"):
            raise UserError(f"data.source={source!r} is not an image source; use fashion_mnist or synthetic")
        for key, value in {"micro_batch_size": micro_batch_size, "val_examples": val_examples}.items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"data.{key}={value!r} must be a positive integer")
        self.side = check_geometry(native_size, image_size, patch_size)
        self.source, self.folder, self.image_size, self.patch_size = source, folder, image_size, patch_size
        self.micro_batch_size, self.seed, self.name, self.split_seed = (
            micro_batch_size,
            seed,
            name,
            split_seed,
        )
        self.limits = {"train": train_examples, "validation": val_examples, "test": test_examples}
        self.synthetic = {"train": synthetic_train, "test": synthetic_test}
        self.num_classes, self.native_size = num_classes, native_size
        self.splits: dict[str, ImageTokens] = {}
        self.meta: dict[str, dict] = {}
        self.samples_per_step = 0

    @property
    def num_tokens(self) -> int:
        return (self.side // self.patch_size) ** 2

    @property
    def token_dim(self) -> int:
        return self.patch_size**2  # greyscale

    def load(self) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        if self.source == "fashion_mnist":
            if not self.folder:
                raise UserError("data.folder is not set; point it at the Fashion-MNIST IDX files")
            return load_fashion_mnist(self.folder)
        return {
            split: synthetic_images(n, 0, split, self.native_size, self.num_classes)
            for split, n in self.synthetic.items()
        }

    def prepare_data(self) -> None:
        if self.splits:
            return
        raw = self.load()
        for split, (x, _) in raw.items():  # every split: a model is only as good as the geometry it reads
            if x.shape[1:] != (self.native_size, self.native_size):
                where = f" in {self.folder}" if self.source == "fashion_mnist" else ""
                fix = (f"set data.native_size={x.shape[1]}" if split == "train" else
                       "give every split images of the training split's size")
                raise UserError(f"{split} images{where} are {x.shape[1]}x{x.shape[2]}, data.native_size says "
                                f"{self.native_size}; {fix}")
        images, labels = raw["train"]
        n_val = self.limits["validation"]
        if n_val >= len(images):
            raise UserError(f"data.val_examples={n_val} leaves no training images out of {len(images)}")
        order = np.random.default_rng(self.split_seed).permutation(len(images))  # the carved validation split
        val_idx, train_idx = np.sort(order[:n_val]), np.sort(order[n_val:])
        if self.limits["train"]:
            train_idx = train_idx[: self.limits["train"]]
        test_images, test_labels = raw["test"]
        if self.limits["test"]:
            test_images, test_labels = test_images[: self.limits["test"]], test_labels[: self.limits["test"]]
        parts = {
            "train": (images[train_idx], labels[train_idx]),
            "validation": (images[val_idx], labels[val_idx]),
            "test": (test_images, test_labels),
        }
        for split, (x, y) in parts.items():
            if not len(y):
                fix = (f"set data.synthetic_{split} to a positive number" if self.source == "synthetic" else
                       f"its IDX files in {self.folder} hold no images; download them again")
                raise UserError(f"the {split} split of data={self.name} has no images; {fix}")
            if int(y.max()) >= self.num_classes:
                raise UserError(
                    f"{split} labels go up to {int(y.max())}, data.num_classes={self.num_classes}"
                )
            self.splits[split] = ImageTokens(x, y, self.image_size, self.patch_size)
            self.meta[split] = {"n_images": len(y)}
        log.info(
            "%s: %s images; %d tokens of %d values per image",
            self.name,
            {k: v["n_images"] for k, v in self.meta.items()},
            self.num_tokens,
            self.token_dim,
        )

    def setup(self, stage: str | None = None) -> None:
        self.prepare_data()

    def train_dataset(self) -> ImageTokens:
        self.prepare_data()
        return self.splits["train"]

    def val_dataset(self) -> ImageTokens:
        self.prepare_data()
        return self.splits["validation"]

    def test_dataset(self) -> ImageTokens:
        self.prepare_data()
        return self.splits["test"]

    def train_dataloader(self) -> DataLoader:
        return stream_loader(self.train_dataset(), self.micro_batch_size, self.seed, self.samples_per_step,
                             self.trainer)

    def val_dataloader(self) -> DataLoader:
        return loader(self.val_dataset(), self.micro_batch_size)
