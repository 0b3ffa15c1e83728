"""Text for language modelling, with no download: the documentation every CPython ships
(`pydoc_data.topics`), a user's text files (byte-level), or nanoGPT-style token files.

A sample is a block of `block_size` tokens and the same block shifted by one (the next tokens to
predict); blocks do not overlap. Text is split into train and validation by document (a pydoc
topic, a file, or a piece of a single file), seeded, so that no validation block shares a
document with a training block. The splits are the same Split / map-style datasets the image data
uses, so sample order, DDP slicing and the resume position work as they do there.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
from torch.utils.data import Dataset as TorchDataset

from halfprec.components.data import Dataset, NumWorkers, PersistentWorkers, Root, Split, Workers, register_dataset
from halfprec.errors import ConfigError
from halfprec.machine import loader_workers
from halfprec.spec import Spec

BlockSize = Annotated[int, Spec(low=1, doc="tokens per sample, the model's context (model.block_size)")]
ValFraction = Annotated[float, Spec(above=0, below=1, doc="share of the documents held out for validation")]
Seed = Annotated[int, Spec(low=0, doc="the train/val split's seed")]
PIECES = 100  # a single text file is cut into this many documents for the train/val split


@register_dataset("pydoc", inputs="tokens", targets="tokens")
def load_pydoc(block_size: BlockSize = 128, val_fraction: ValFraction = 0.1, seed: Seed = 0) -> Dataset:
    """The text of the running interpreter's own documentation (about 465 KB), byte-level."""
    from pydoc_data.topics import topics

    documents = [topics[key].encode("utf-8") for key in sorted(topics)]
    corpus = f"the pydoc text is {sum(map(len, documents))} bytes"
    return byte_dataset(documents, block_size, val_fraction, seed, corpus)


@register_dataset("text", inputs="tokens", targets="tokens")
def load_text(
    root: Root = "data/text",
    block_size: BlockSize = 128,
    val_fraction: ValFraction = 0.1,
    seed: Seed = 0,
    pattern: Annotated[str, Spec(nonempty=True, doc="which files under data.root, e.g. *.txt")] = "*.txt",
) -> Dataset:
    """Every file under `root` matching `pattern` (searched recursively), byte-level."""
    where = Path(root)
    files = sorted(p for p in where.rglob(pattern) if p.is_file()) if where.is_dir() else []
    if not files:
        found = "no such directory" if not where.is_dir() else f"no file matching {pattern} in it"
        raise ConfigError("data.root", root, f"{found}; put text files there or set data.pattern")
    contents = [f.read_bytes() for f in files]
    # sizes as `ls -l` shows them: the files' bytes, before any splitting or separators
    matching = f"the {len(files)} files matching {pattern} in data.root"
    if not any(contents):  # not block_size advice: no block size fits no text
        empty = f"{files[0]} is empty" if len(files) == 1 else f"{matching} are all empty"
        raise ConfigError("data.root", root, f"{empty}: put some text there")
    if len(files) == 1:
        corpus = f"{files[0]} is {len(contents[0])} bytes"
    else:
        corpus = f"{matching} are {sum(map(len, contents))} bytes in all"
    # an empty file is no document: in the split it would only hold out separators for validation
    documents = [data for data in contents if data]
    if len(documents) == 1:  # one file: pieces of it are the documents of the split
        whole = documents[0]
        step = -(-len(whole) // PIECES)
        documents = [whole[i : i + step] for i in range(0, len(whole), step)]
    return byte_dataset(documents, block_size, val_fraction, seed, corpus)


def byte_dataset(
    documents: list[bytes], block_size: int, val_fraction: float, seed: int, corpus: str = "the text"
) -> Dataset:
    """Bytes as tokens (vocabulary 256): a seeded split of the documents, each side cut into blocks.
    `corpus` says where the documents come from and their real size, for an error about it."""
    order = torch.randperm(len(documents), generator=torch.Generator().manual_seed(seed)).tolist()
    wanted, val_docs, held = val_fraction * sum(map(len, documents)), [], 0
    for i in order:  # documents in seeded order, those that keep validation within its share
        if held + len(documents[i]) <= wanted:
            val_docs.append(i)
            held += len(documents[i])
    if not val_docs or len(val_docs) == len(documents):
        val_docs = [min(order, key=lambda i: len(documents[i]))]  # at least one of each
    train_docs = [i for i in order if i not in val_docs]
    sides = {"training": train_docs, "validation": val_docs}
    joined = {side: b"\n\n".join(documents[i] for i in sorted(docs)) for side, docs in sides.items()}
    for side, data in joined.items():
        if len(data) <= block_size:  # not one block with its next-token target
            held = sum(len(documents[i]) for i in sides[side])  # the text's own bytes, no separators
            raise too_short(block_size, corpus, side, held, joined)
    train, val = (blocks(joined[side], block_size) for side in sides)
    return Dataset(train, val, (block_size,), 256, bytes_per_token=1.0)


def too_short(block_size: int, corpus: str, side: str, held: int, joined: dict[str, bytes]) -> ConfigError:
    """Why no block fits, in sizes the user can check, and the largest block_size that would work."""
    most = min(map(len, joined.values())) - 1  # the split does not depend on block_size
    fix = f"use model.block_size<={most} or more text" if most >= 1 else "add more text"
    if side == "validation":
        fix += " (or a larger data.val_fraction)"
    need = f"a block needs {block_size + 1} bytes (block_size + 1) on each side of the train/val split"
    where = f"{corpus}, the {side} split holds {held} of them"
    return ConfigError("data.block_size", block_size, f"longer than the text: {where}; {need}: {fix}")


def blocks(data: bytes, block_size: int) -> Split:
    """Non-overlapping blocks of `block_size` tokens, each with its next tokens as the targets."""
    tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8).long()
    n = (len(tokens) - 1) // block_size
    x = tokens[: n * block_size].view(n, block_size)
    y = tokens[1 : n * block_size + 1].view(n, block_size)
    return Split(x, y)


class TokenBlocks(TorchDataset):
    """Non-overlapping blocks of a token file read through a memory map: a corpus much larger than
    memory is fine, each sample is read when a DataLoader worker asks for it."""

    def __init__(self, tokens: np.ndarray, block_size: int):
        self.tokens, self.block_size = tokens, block_size
        self.n = (len(tokens) - 1) // block_size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.block_size
        chunk = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


@register_dataset("tokens", inputs="tokens", targets="tokens")
def load_tokens(
    root: Root = "data/tokens",
    block_size: BlockSize = 1024,
    vocab_size: Annotated[int, Spec(low=2, doc="tokens the files use, e.g. 50257 for GPT-2's")] = 50257,
    bytes_per_token: Annotated[float | None, Spec(above=0, doc="for val/bpb; null: not reported")] = None,
    dtype: Annotated[
        Literal["uint16", "uint32"], Spec(doc="the ids' type in the files: uint16 (nanoGPT's), uint32 past 65,536 ids")
    ] = "uint16",
    num_workers: NumWorkers = "auto",
    persistent_workers: PersistentWorkers = None,
) -> Dataset:
    """nanoGPT's format: `train.bin` and `val.bin` in `root`, token ids as uint16 (or uint32)."""
    if vocab_size > 2**16 and dtype == "uint16":
        raise ConfigError(
            "data.dtype", dtype, f"holds ids up to 65535 and data.vocab_size={vocab_size} goes beyond: files of "
            "larger vocabularies hold uint32 ids, data.dtype=uint32",
        )  # fmt: skip
    kind = np.dtype(dtype)
    splits = [
        TokenBlocks(read_token_file(Path(root) / name, vocab_size, kind), block_size)
        for name in ("train.bin", "val.bin")
    ]
    for name, split in zip(("train.bin", "val.bin"), splits):
        if len(split) < 1:  # not one block with its next-token target
            n = len(split.tokens)
            fix = f"use model.block_size<={n - 1}" if n > 1 else "it needs more tokens"
            need = f"a block needs {block_size + 1} (block_size + 1)"
            raise ConfigError("data.block_size", block_size, f"{Path(root) / name} holds {n} tokens, {need}: {fix}")
    workers = Workers(loader_workers(num_workers, most=4), False, persistent_workers)
    return Dataset(splits[0], splits[1], (block_size,), vocab_size, workers, bytes_per_token=bytes_per_token)


def read_token_file(path: Path, vocab_size: int, dtype: np.dtype) -> np.ndarray:
    """A memory map of a token file of `dtype` ids; a missing or malformed one is one clear error."""
    if not path.is_file():
        raise ConfigError(
            "data.root", str(path.parent), f"no {path.name} here: nanoGPT-style {dtype} token files expected"
        )
    size = path.stat().st_size
    if size == 0:
        raise ConfigError("data.root", str(path.parent), f"{path.name} is empty (0 bytes): it holds no tokens")
    if size % dtype.itemsize:
        raise ConfigError(
            "data.root", str(path.parent), f"{path.name} is {size} bytes, not a multiple of {dtype.itemsize}: not a "
            f"{dtype} token file",
        )  # fmt: skip
    tokens = np.memmap(path, dtype=dtype, mode="r")
    if dtype == np.uint16 and looks_like_uint32(tokens):
        raise ConfigError(
            "data.dtype", "uint16", f"{path}: every second 16-bit value is 0, as in a file of uint32 ids below "
            "65536 read as uint16: set data.dtype=uint32",
        )  # fmt: skip
    check_token_ids(path, tokens, vocab_size)
    return tokens


def looks_like_uint32(tokens: np.ndarray, sample: int = 1 << 20) -> bool:
    """uint32 ids read as uint16 (little-endian): each id's high half, 0 below 65536, at every odd
    position. Judged on the first million values; a real uint16 corpus is never zero at every odd
    position (and a file of zeros alone is left to the other checks)."""
    head = np.asarray(tokens[: sample - sample % 2])
    return len(head) >= 64 and not head[1::2].any() and bool(head[0::2].any())


def looks_like_uint16(tokens: np.ndarray, sample: int = 1 << 20) -> bool:
    """uint16 ids read as uint32: two ids make one, past 65535 unless the second is 0, so most of
    them are; in a real large vocabulary's corpus the frequent ids are the small ones."""
    head = np.asarray(tokens[:sample])
    return bool(np.count_nonzero(head > np.iinfo(np.uint16).max) * 2 > len(head))


CHUNK = 1 << 24  # tokens per look (32 MB): a corpus larger than memory is scanned a piece at a time


def check_token_ids(path: Path, tokens: np.ndarray, vocab_size: int) -> None:
    """Every id below `vocab_size`, all of the file: one id out of range anywhere would otherwise be an
    IndexError in the embedding, hours into training, when a batch first holds it."""
    if vocab_size > np.iinfo(tokens.dtype).max:  # no id of this type can be out of range: skip reading the file
        return
    first, top = -1, 0
    for start in range(0, len(tokens), CHUNK):
        chunk = tokens[start : start + CHUNK]
        top = max(top, int(chunk.max()))
        if first < 0 and top >= vocab_size:  # the earlier chunks were all in range: the first is in this one
            first = start + int(np.argmax(chunk >= vocab_size))
    if first >= 0:
        where = f"{path} holds token id {int(tokens[first])} at position {first} (of {len(tokens)}, from 0)"
        fix = f"set data.vocab_size to at least {top + 1} (its largest id + 1), or use files made for {vocab_size} ids"
        if tokens.dtype == np.uint32 and looks_like_uint16(tokens):
            fix += "; if the files hold uint16 ids, data.dtype=uint16"
        raise ConfigError("data.vocab_size", vocab_size, f"{where}, not below data.vocab_size: {fix}")
