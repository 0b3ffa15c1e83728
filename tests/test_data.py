"""The datasets read from disk: torchvision's CIFAR10 and ImageFolder on tiny files in the real formats,
the DataLoader-backed batches (order, rank slices, resume), their config errors, and runs end to end."""

from __future__ import annotations

import pickle
import subprocess
import sys

import pytest
import torch
from conftest import read_jsonl
from tiny_data import write_cifar10, write_imagefolder
from torch.utils.data import TensorDataset

from halfprec.components.data import Dataset
from halfprec.components.data.arrays import make_synthetic
from halfprec.components.data.batches import IGNORE_LABEL, Batches, LoaderBatches, Split, Workers
from halfprec.components.data.image_files import load_cifar10, load_imagefolder
from halfprec.components.vision import CIFAR10_MEAN, CIFAR10_STD, IMAGENET_MEAN, IMAGENET_STD
from halfprec.config import validate
from halfprec.errors import ConfigError
from halfprec.training.checkpoint import checkpoint_files, load_checkpoint
from halfprec.training.run import run

from helpers import compose_cfg

CPU = torch.device("cpu")
TINY_RESNET = ["model=fixup_resnet", "model.blocks_per_stage=1", "model.widths=[4,8,8]"]


@pytest.fixture(scope="module")
def cifar_root(tmp_path_factory):
    return write_cifar10(tmp_path_factory.mktemp("cifar10"))  # 5 x 8 train images, 16 test images


@pytest.fixture(scope="module")
def cifar(cifar_root):
    return load_cifar10(str(cifar_root), verify=False, num_workers=0)


@pytest.fixture(scope="module")
def folder_root(tmp_path_factory):
    return write_imagefolder(tmp_path_factory.mktemp("imagefolder"))  # 3 classes, 8 train / 3 val each


@pytest.fixture(scope="module", autouse=True)
def cli_runs(cli, cifar_root, tmp_path_factory):
    """The `python train.py` subprocesses, started before the first test: each pays ~8 s of imports."""
    common = ["data=cifar10", "data.verify=false", "logger=none", "trainer.progress=false"]
    missing = tmp_path_factory.mktemp("empty") / "cifar10"
    return {
        "train": cli.submit(*common, f"data.root={cifar_root}", *TINY_RESNET),  # num_workers=auto
        "missing": cli.submit(*common, f"data.root={missing}"),
    }


def batches_of(stream, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(stream) for _ in range(n)]


def assert_same(a: list, b: list) -> None:
    assert len(a) == len(b)
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(ya, yb) and torch.equal(xa, xb)


# ---------------------------------------------------------------------------------------------
# torchvision's readers and transforms
# ---------------------------------------------------------------------------------------------


def test_cifar10_is_read_and_normalized_by_torchvision(cifar):
    assert (cifar.num_classes, cifar.input_shape, len(cifar.train), len(cifar.val)) == (10, (3, 32, 32), 40, 16)
    names = lambda compose: [type(t).__name__ for t in compose.transforms]  # noqa: E731
    assert names(cifar.train.transform) == ["RandomCrop", "RandomHorizontalFlip", "ToTensor", "Normalize"]
    assert cifar.train.transform.transforms[0].padding == 4
    assert names(cifar.val.transform) == ["ToTensor", "Normalize"]

    ((x, y),) = list(cifar.val_batches(256, CPU))  # the test split, in file order
    assert x.shape == (16, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert y.tolist() == [i % 10 for i in range(16)]
    raw = torch.from_numpy(cifar.val.data).permute(0, 3, 1, 2).float() / 255  # HWC uint8 -> CHW in [0, 1]
    mean, std = torch.tensor(CIFAR10_MEAN).view(3, 1, 1), torch.tensor(CIFAR10_STD).view(3, 1, 1)
    torch.testing.assert_close(x, (raw - mean) / std)
    assert (raw[:, 0, 0, 0] * 255).round().tolist() == list(range(16))  # tiny_data's image numbers

    x, y = next(cifar.train_batches(8, 0, CPU))
    assert x.shape == (8, 3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64


def test_imagefolder_takes_classes_from_folders_and_crops_to_image_size(folder_root):
    data = load_imagefolder(str(folder_root), image_size=32, num_workers=0)
    assert (data.num_classes, data.input_shape, len(data.train), len(data.val)) == (3, (3, 32, 32), 24, 9)
    assert data.train.classes == ["cat", "dog", "fox"]
    crop, flip, _, norm = data.train.transform.transforms
    assert (type(crop).__name__, crop.size, type(flip).__name__) == (
        "RandomResizedCrop",
        (32, 32),
        "RandomHorizontalFlip",
    )
    resize, center, _, _ = data.val.transform.transforms
    assert (resize.size, center.size) == (36, (32, 32))  # int(32 * 256 / 224), then the center crop
    assert (tuple(norm.mean), tuple(norm.std)) == (IMAGENET_MEAN, IMAGENET_STD)

    ((x, y),) = list(data.val_batches(256, CPU))
    assert x.shape == (9, 3, 32, 32) and x.dtype == torch.float32 and y.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    pixels = x * torch.tensor(IMAGENET_STD).view(3, 1, 1) + torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
    assert pixels.min() >= -1e-6 and pixels.max() <= 1 + 1e-6
    x, y = next(data.train_batches(5, 0, CPU))
    assert x.shape == (5, 3, 32, 32) and set(y.tolist()) <= {0, 1, 2}


# ---------------------------------------------------------------------------------------------
# Batches from a DataLoader: the in-memory order, rank slices, resume
# ---------------------------------------------------------------------------------------------


class Numbers(torch.utils.data.Dataset):
    """Sample i is (a random draw, i): the draw stands in for a random augmentation. Records what it loads."""

    def __init__(self, n: int):
        self.n, self.loaded = n, []

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        self.loaded.append(i)
        return torch.rand(2), i


def test_loader_batches_walk_the_in_memory_order_and_the_seed_decides_it():
    n, b = 50, 8  # 6 batches an epoch, 2 samples dropped: 15 batches cross two epoch ends
    memory = Batches(Split(torch.arange(n).float(), torch.arange(n)), b, seed=3, device=CPU)
    loaded = batches_of(LoaderBatches(Numbers(n), b, seed=3, device=CPU), 15)
    assert [y.tolist() for _, y in loaded] == [y.tolist() for _, y in batches_of(memory, 15)]
    assert_same(loaded, batches_of(LoaderBatches(Numbers(n), b, seed=3, device=CPU), 15))
    other = batches_of(LoaderBatches(Numbers(n), b, seed=4, device=CPU), 15)
    assert [y.tolist() for _, y in other] != [y.tolist() for _, y in loaded]
    epochs = [set(torch.cat([y for _, y in loaded[i : i + 6]]).tolist()) for i in (0, 6)]
    assert all(len(e) == 48 for e in epochs) and epochs[0] != epochs[1]  # reshuffled: other samples dropped


def test_two_ranks_together_see_what_one_rank_with_twice_the_batch_sees(cifar):
    one = batches_of(LoaderBatches(cifar.train, 8, seed=0, device=CPU), 12)  # 5 batches an epoch
    ranks = [batches_of(LoaderBatches(cifar.train, 4, 0, CPU, rank, world_size=2), 12) for rank in (0, 1)]
    together = [(torch.cat([x0, x1]), torch.cat([y0, y1])) for (x0, y0), (x1, y1) in zip(*ranks)]
    assert_same(together, one)  # the augmented pixels too: each sample has its own augmentation seed


@pytest.mark.parametrize("source", ["in-memory", "cifar10", "TensorDataset"])
def test_ranks_split_validation_into_equal_shares_that_hold_each_sample_once(source, cifar):
    # 16 samples over 3 ranks: 6, 5 and 5, the short ranks padded to 6 with ignored labels, so that
    # every rank runs the same number of forwards (FSDP's forward is a collective). CIFAR-10's labels
    # are ints, a TensorDataset's tensors: the padding's label must collate with either.
    data = cifar if source == "cifar10" else make_synthetic(shape=[1, 4, 4], num_train=8, num_val=16)
    if source == "TensorDataset":
        data = Dataset(data.train, TensorDataset(data.val.x, data.val.y), data.input_shape, data.num_classes)
    ((x_all, y_all),) = list(data.val_batches(256, CPU))
    seen = {}
    for rank in range(3):
        share = list(data.val_batches(4, CPU, rank, world_size=3))
        assert [len(y) for _, y in share] == [4, 2]
        x, y = torch.cat([x for x, _ in share]), torch.cat([y for _, y in share])
        for j in range(6):
            index = rank + 3 * j
            if index < 16:
                assert y[j] == y_all[index] and torch.equal(x[j], x_all[index])
                seen[index] = rank
            else:
                assert y[j] == IGNORE_LABEL
    assert sorted(seen) == list(range(16))
    assert [len(y) for _, y in data.val_batches(256, CPU)] == [16]  # one process: the whole split, as before


def test_resume_continues_the_sequence_without_loading_the_skipped_samples():
    straight = batches_of(LoaderBatches(Numbers(50), 8, seed=1, device=CPU), 14)
    first = LoaderBatches(Numbers(50), 8, seed=1, device=CPU)
    batches_of(first, 9)  # into the second epoch
    state = first.state_dict()
    assert state == {"epoch": 1, "index": 24, "seed": 1}

    numbers = Numbers(50)
    resumed = LoaderBatches(numbers, 8, seed=0, device=CPU)  # the seed comes from the state
    resumed.load_state_dict(state)
    assert_same(batches_of(resumed, 5), straight[9:])
    assert numbers.loaded == torch.cat([y for _, y in straight[9:]]).tolist()  # nothing before the position


def test_worker_processes_give_the_same_batches(cifar):
    in_process = batches_of(cifar.train_batches(8, 0, CPU), 7)
    workers = LoaderBatches(cifar.train, 8, seed=0, device=CPU, workers=Workers(num_workers=2))
    assert workers.loader.persistent_workers  # null: persistent whenever there are workers
    assert_same(batches_of(workers, 7), in_process)  # across an epoch end, with persistent workers


# ---------------------------------------------------------------------------------------------
# Errors: key, value, and what would work
# ---------------------------------------------------------------------------------------------


def test_missing_cifar10_names_the_key_the_place_and_the_download(tmp_path, cifar_root):
    with pytest.raises(ConfigError) as err:
        load_cifar10(str(tmp_path / "nowhere"))
    message = str(err.value)
    assert message.startswith(f"data.root={tmp_path / 'nowhere'}: no CIFAR-10 here")
    for needle in ("cifar-10-batches-py/", "data_batch_1..5", "https://www.cs.toronto.edu/~kriz/cifar.html"):
        assert needle in message
    assert "data.download=true" in message and "\n" not in message

    partial = write_cifar10(tmp_path / "partial", per_batch=1, test=1)
    (partial / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(ConfigError, match="missing test_batch"):
        load_cifar10(str(partial))
    with pytest.raises(ConfigError, match=r"md5 sums .* data\.verify=false"):  # files there, not the originals
        load_cifar10(str(cifar_root))


def test_download_without_a_network_is_a_config_error(tmp_path, monkeypatch):
    import urllib.error

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setattr("torchvision.datasets.cifar.download_and_extract_archive", offline)
    with pytest.raises(ConfigError, match=r"data\.download=true: could not fetch CIFAR-10 .*Name or service"):
        load_cifar10(str(tmp_path), download=True)


def test_bad_imagefolder_trees_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.root=.*no ImageFolder tree here .*missing train/ and val/"):
        load_imagefolder(str(tmp_path))
    root = write_imagefolder(tmp_path / "tree", classes=("a", "b"), train=1, val=1, size=8)
    (root / "val" / "b" / "0.png").rename(root / "val" / "a" / "1.png")
    (root / "val" / "b").rmdir()
    with pytest.raises(ConfigError, match=r"same class folders \(only in train/: \['b'\]"):
        load_imagefolder(str(root))


def test_batch_larger_than_the_training_set_is_a_config_error(cifar):
    with pytest.raises(ConfigError, match=r"data\.batch_size=32: must be <= 20: the 40 training samples"):
        LoaderBatches(cifar.train, 32, seed=0, device=CPU, world_size=2)


def test_persistent_workers_need_workers():
    validate(compose_cfg("data=cifar10", "data.num_workers=0"))  # null: not persistent without workers
    with pytest.raises(ConfigError) as err:
        validate(compose_cfg("data=cifar10", "data.num_workers=0", "data.persistent_workers=true"))
    assert str(err.value).startswith("data.persistent_workers=true: ") and "data.num_workers >= 1" in str(err.value)
    with pytest.raises(ConfigError, match=r"data\.num_workers=-1: must be auto or an integer >= 0"):
        validate(compose_cfg("data=imagefolder", "data.num_workers=-1"))


# ---------------------------------------------------------------------------------------------
# End to end
# ---------------------------------------------------------------------------------------------


def test_train_py_on_cifar10_with_workers_writes_metrics(cli_runs):
    result = cli_runs["train"].result()
    result.check()
    rows = result.metrics()
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3]
    assert all(r["samples"] == r["step"] * 16 for r in rows) and 0 <= rows[-1]["val/acc"] <= 1
    # workers chosen from the machine: torch does not warn of more worker processes than cores
    assert "worker processes in total" not in result.output


def test_train_py_without_cifar10_exits_2_with_one_line(cli_runs):
    result = cli_runs["missing"].result()
    assert result.returncode == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: data.root=") and "no CIFAR-10 here" in line and "data.download=true" in line
    assert not (result.run_dir / "metrics.jsonl").exists()


def test_resumed_cifar10_run_equals_an_uninterrupted_one(cifar_root, tmp_path):
    common = ["data=cifar10", f"data.root={cifar_root}", "data.verify=false", "data.num_workers=0", *TINY_RESNET]
    common += ["data.batch_size=16", "sched=constant", "trainer.log_every=1", "trainer.val_every=0"]
    run(compose_cfg(*common, "trainer.max_steps=6"), tmp_path / "straight")  # 2 batches an epoch: 3 epochs
    run(compose_cfg(*common, "trainer.max_steps=3"), tmp_path / "resumed")
    ckpt = load_checkpoint(checkpoint_files(tmp_path / "resumed" / "checkpoints")[-1])
    assert ckpt["data"] == {"epoch": 1, "index": 16, "seed": 0}
    run(compose_cfg(*common, "trainer.max_steps=6", "resume=auto"), tmp_path / "resumed")

    losses = [{r["step"]: r["train/loss"] for r in read_jsonl(d / "metrics.jsonl") if "train/loss" in r}
              for d in (tmp_path / "straight", tmp_path / "resumed")]  # fmt: skip
    assert losses[0] == losses[1] and list(losses[0]) == [1, 2, 3, 4, 5, 6]


def test_tiny_cifar10_files_are_pickles_of_the_documented_layout(cifar_root):
    with open(cifar_root / "cifar-10-batches-py" / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="latin1")
    assert batch["data"].dtype.name == "uint8" and batch["data"].shape == (8, 3072) and len(batch["labels"]) == 8


def test_digits_are_read_without_importing_scikit_learn_and_equal_its_loader():
    # the fast path reads the file scikit-learn ships; its own loader must give the same data
    import subprocess
    import sys

    code = "import sys; from halfprec.components.data.arrays import load_digits; load_digits(); "
    code += "print('sklearn' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
    from sklearn.datasets import load_digits as sk_load_digits

    from halfprec.components.data.arrays import _digits_arrays

    pixels, labels = _digits_arrays()
    reference = sk_load_digits()
    assert (pixels == reference.data).all() and (labels == reference.target).all()


@pytest.mark.parametrize(
    "module", ["halfprec.components.data.text", "halfprec.components.data.batches", "halfprec.components.data"]
)
def test_any_data_module_imports_first_and_the_registry_is_whole(module):
    """Every module of the package registers its datasets, whichever is imported first (data.py and
    text.py once imported each other: text first was an AttributeError)."""
    code = f"import {module}; from halfprec.components.data import DATASETS; print(' '.join(sorted(DATASETS)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["cifar10", "digits", "imagefolder", "pydoc", "synthetic", "text", "tokens"]
