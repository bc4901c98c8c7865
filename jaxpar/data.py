"""Deterministic, resumable batches placed sharded over ``dp`` from the start.

Every source is a flat token array with a held-out split. Row ``r`` of the batch of step ``i``
is a window at an offset drawn from ``numpy.random.default_rng((seed, i, r))``, so:

- the global batch of a step does not depend on the layout (equivalence tests rely on it);
- resuming at step ``i`` needs no saved iterator state beyond ``i`` itself;
- a host builds only the rows of the devices it owns (``jax.make_array_from_callback``), never
  the whole batch.

Sources: ``stdlib`` — the Python standard library's own ``.py`` files (present on every machine,
no download), byte-level tokens, files split train/held-out by a hash of their path;
``synthetic`` — a learnable stream (repeated random-stride counting); or a path to a ``.bin``
file of uint16/uint32 tokens (memory-mapped, its last 5% held out).
"""

from __future__ import annotations

import functools
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from jaxpar.errors import ConfigError

HELD_OUT_MOD = 20  # one file in 20 (by path hash) is held out of the stdlib corpus
_SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Corpus:
    """Train and held-out token arrays (any integer dtype, possibly memory-mapped)."""

    train: np.ndarray
    heldout: np.ndarray
    vocab_size: int
    name: str


@functools.lru_cache(maxsize=2)
def stdlib_corpus(max_bytes: int = 16_000_000) -> Corpus:
    """Byte-level corpus of the standard library's source files (train / held-out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if not (_SKIP_DIRS & set(p.parts)))
    train, held, total = [], [], 0
    for p in files:
        rel = p.relative_to(root).as_posix()
        data = p.read_bytes() + b"\n\n"
        total += len(data)
        if total > max_bytes:
            break
        (held if zlib.crc32(rel.encode()) % HELD_OUT_MOD == 0 else train).append(data)
    if not train or not held:
        raise ConfigError(f"train.data='stdlib': no Python sources found under {root}")
    as_arr = lambda chunks: np.frombuffer(b"".join(chunks), dtype=np.uint8)  # noqa: E731
    return Corpus(as_arr(train), as_arr(held), 256, "stdlib")


def synthetic_corpus(vocab_size: int, n_tokens: int = 1 << 20, seed: int = 1234) -> Corpus:
    """A learnable stream: runs of ``start, start+k, start+2k, ...`` modulo the vocabulary."""
    rng = np.random.default_rng(seed)
    runs = n_tokens // 64
    starts = rng.integers(0, vocab_size, runs)[:, None]
    strides = rng.integers(1, 8, runs)[:, None]
    tokens = ((starts + strides * np.arange(64)[None, :]) % vocab_size).reshape(-1)
    tokens = tokens.astype(np.uint32)
    cut = int(len(tokens) * 0.95)
    return Corpus(tokens[:cut], tokens[cut:], vocab_size, "synthetic")


def token_file_corpus(path: str, dtype: str) -> Corpus:
    """A memory-mapped ``.bin`` token file; its last 5% is the held-out split."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"train.data={path!r}: token file does not exist")
    tokens = np.memmap(p, dtype=np.dtype(dtype), mode="r")
    cut = int(len(tokens) * 0.95)
    return Corpus(tokens[:cut], tokens[cut:], int(np.iinfo(tokens.dtype).max) + 1, p.name)


def load_corpus(data: str, vocab_size: int, dtype: str = "uint16") -> Corpus:
    """Resolve ``train.data`` to a corpus."""
    if data == "stdlib":
        corpus = stdlib_corpus()
    elif data == "synthetic":
        corpus = synthetic_corpus(vocab_size)
    else:
        corpus = token_file_corpus(data, dtype)
    if corpus.name == "stdlib" and vocab_size < 256:
        raise ConfigError(f"model.vocab_size={vocab_size}: byte-level data needs at least 256")
    return corpus


class Batches:
    """Deterministic batches of ``[global_batch, seq_len + 1]`` windows (inputs + next token).

    ``rows(step, lo, hi, split)`` builds rows ``lo:hi`` of a step's batch; ``global_batch``
    rows make the whole batch. Held-out batches use negative step numbers so they never
    coincide with training batches.
    """

    def __init__(self, corpus: Corpus, global_batch: int, seq_len: int, seed: int):
        self.corpus, self.global_batch, self.seq_len, self.seed = (
            corpus,
            global_batch,
            seq_len,
            seed,
        )
        for split in ("train", "heldout"):
            if len(getattr(corpus, split)) <= seq_len + 1:
                raise ConfigError(
                    f"train.seq_len={seq_len}: longer than the {split} split of "
                    f"{corpus.name} ({len(getattr(corpus, split))} tokens)"
                )

    def rows(self, step: int, lo: int, hi: int, split: str = "train") -> np.ndarray:
        """Rows ``lo:hi`` of step ``step``'s batch as int32 ``[hi-lo, seq_len+1]``."""
        tokens = self.corpus.train if split == "train" else self.corpus.heldout
        span = len(tokens) - self.seq_len - 1
        tag = 0 if split == "train" else 1
        out = np.empty((hi - lo, self.seq_len + 1), np.int32)
        for i, r in enumerate(range(lo, hi)):
            start = int(np.random.default_rng((self.seed, tag, step, r)).integers(0, span))
            out[i] = tokens[start : start + self.seq_len + 1]
        return out

    def global_array(self, step: int, sharding, split: str = "train"):
        """The step's batch as one global ``jax.Array`` with ``sharding`` (rows over ``dp``).

        Each addressable device's callback builds only its own rows.
        """
        import jax

        shape = (self.global_batch, self.seq_len + 1)

        def cb(index):
            rows = index[0]
            lo, hi, _ = rows.indices(self.global_batch)
            block = self.rows(step, lo, hi, split)
            return block[:, index[1]]

        return jax.make_array_from_callback(shape, sharding, cb)
