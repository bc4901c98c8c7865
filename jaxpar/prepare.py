"""``jaxpar data prepare``: text → ``NAME.bin`` + sidecar ``NAME.json``, in parallel, deterministic.

Inputs are text files (one document each), ``.jsonl`` files (one document per line, the string
field ``text_field``), directories (every non-hidden file below, sorted; files with a NUL byte in
their first 8 KiB are skipped as binary), or ``stdlib`` (the embedded corpus's files,
:func:`jaxpar.data.stdlib_files`). Documents are numbered in that order; document ``i`` is held
out when ``floor((i+1)·f) > floor(i·f)`` for ``f = validation_fraction``: exactly
``floor(n·f)`` documents, evenly spread, independent of how the work is split.

The reader cuts the document stream into chunks of about 1 MiB and worker processes (forked;
spawned when JAX runs in the process, whose threads make forking unsafe) tokenise them; results
are written strictly in chunk order with at most two chunks per worker in flight, so the output
is byte-identical for any worker count and memory stays bounded. Every document ends with the
end-of-text token. The run holds ``NAME.bin.lock`` (:func:`jaxpar.lock.output_lock`) while it
writes, so a second run into the same ``--out`` is refused naming the first; outputs are written
to temporary names unique to the run and renamed when complete; nothing is left behind on an
error.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import os
import sys
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxpar import tokenizer as T
from jaxpar.data import sidecar_path, stdlib_files, write_sidecar
from jaxpar.errors import ConfigError, JaxparError
from jaxpar.lock import output_lock, replace_dir, temp_name

STDLIB = "stdlib"
CHUNK_BYTES = 1 << 20
_BINARY_PROBE = 8192


@dataclass(frozen=True)
class Source:
    """One input file (or an embedded-corpus file) and how to read it."""

    path: Path
    name: str  # as reported (relative to the input it was found under)
    jsonl: bool


def list_sources(inputs: list[str], exclude: tuple[Path, ...] = ()) -> list[Source]:
    """Input files in document order; refuses a missing input in one line."""
    if not inputs:
        raise ConfigError("inputs: none given (text files, directories, .jsonl, or 'stdlib')")
    skip = {p.resolve() for p in exclude}
    out: list[Source] = []
    for item in inputs:
        if item == STDLIB:
            out += [Source(p, f"stdlib/{rel}", False) for rel, p in stdlib_files()]
            continue
        p = Path(item)
        if p.is_dir():
            files = sorted(
                f
                for f in p.rglob("*")
                if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts)
            )
        elif p.is_file():
            files = [p]
        else:
            raise ConfigError(f"input {item!r}: no such file or directory")
        out += [
            Source(f, f.as_posix(), f.suffix == ".jsonl") for f in files if f.resolve() not in skip
        ]
    return out


def _is_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_BINARY_PROBE)


def documents(sources: list[Source], text_field: str = "text") -> Iterator[tuple[str, int]]:
    """``(text, input_bytes)`` of every document; ``input_bytes`` is the share of the input
    files it consumed (for progress). Binary files yield nothing."""
    for src in sources:
        if not src.jsonl:
            if not _is_binary(src.path):
                yield (
                    src.path.read_text(encoding="utf-8", errors="replace"),
                    src.path.stat().st_size,
                )
            continue
        with open(src.path, "rb") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except ValueError as e:
                    raise ConfigError(f"{src.name}:{lineno}: not a JSON line ({e})") from None
                text = record.get(text_field) if isinstance(record, dict) else None
                if not isinstance(text, str):
                    raise ConfigError(
                        f"{src.name}:{lineno}: no string field {text_field!r} (--text-field)"
                    )
                yield text, len(line)


def held_out(i: int, fraction: float) -> bool:
    """Whether document ``i`` belongs to the validation split."""
    return int((i + 1) * fraction) > int(i * fraction)


def _chunks(docs: Iterator[tuple[str, int]], fraction: float):
    """Lists of ``(held_out, text)`` of about :data:`CHUNK_BYTES`, with their input bytes."""
    chunk: list[tuple[bool, str]] = []
    size = consumed = 0
    for i, (text, nbytes) in enumerate(docs):
        chunk.append((held_out(i, fraction), text))
        size += len(text)
        consumed += nbytes
        if size >= CHUNK_BYTES:
            yield chunk, consumed
            chunk, size, consumed = [], 0, 0
    if chunk:
        yield chunk, consumed


_TOK: T.Tokenizer | None = None


def _init_worker(spec: str, eos: str | None) -> None:
    global _TOK
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per worker process
    _TOK = T.load(spec, eos)


def _encode(chunk: list[tuple[bool, str]]) -> tuple[np.ndarray, np.ndarray, int, int]:
    """Token ids of a chunk's training and validation documents, and their counts."""
    assert _TOK is not None
    ids = T.document_ids(_TOK, [text for _, text in chunk])

    def flat(held: bool) -> np.ndarray:
        picked = [d for (h, _), d in zip(chunk, ids, strict=True) if h == held]
        return np.fromiter(itertools.chain.from_iterable(picked), np.uint32)

    n_val = sum(held for held, _ in chunk)
    return flat(False), flat(True), len(chunk) - n_val, n_val


def token_dtype(vocab_size: int) -> str:
    """The smallest unsigned dtype holding every id of the vocabulary."""
    return "uint8" if vocab_size <= 256 else "uint16" if vocab_size <= 65536 else "uint32"


def validation_path(out: Path) -> Path:
    """``NAME.val.bin`` beside ``NAME.bin``."""
    return out.with_name(out.stem + ".val.bin")


class _Writer:
    """Appends tokens to a temporary name of this run; :meth:`commit` renames it into place."""

    def __init__(self, path: Path, dtype: str):
        self.path, self.tmp = path, temp_name(path)
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.f = open(self.tmp, "wb")
        self.tokens = self.docs = 0

    def write(self, ids: np.ndarray, docs: int) -> None:
        self.f.write(ids.astype(self.dtype).tobytes())
        self.tokens += len(ids)
        self.docs += docs

    def commit(self) -> None:
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        self.tmp.unlink(missing_ok=True)


def prepare(
    inputs: list[str],
    tokenizer: str,
    out: str | Path,
    text_field: str = "text",
    validation_fraction: float = 0.0,
    workers: int | None = None,
    eos: str | None = None,
    force: bool = False,
    progress: bool = True,
) -> dict[str, Any]:
    """Tokenise ``inputs`` into ``out`` (+ ``NAME.val.bin`` when ``validation_fraction > 0``)
    with their sidecars; returns the summary (the ``--json`` object)."""
    out = Path(out)
    if not 0.0 <= validation_fraction < 1.0:
        raise ConfigError(f"--validation-fraction={validation_fraction}: must be in [0, 1)")
    if out.suffix != ".bin":
        raise ConfigError(f"--out={str(out)!r}: must end in .bin (the sidecar is NAME.json)")
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers={workers}: must be a positive integer")
    if not out.parent.is_dir():
        raise ConfigError(f"--out={str(out)!r}: directory {out.parent} does not exist")
    lock = output_lock(out, f"--out={str(out)!r}")
    try:
        return _prepare(inputs, tokenizer, out, text_field, validation_fraction, workers, eos,
                        force, progress)  # fmt: skip
    finally:
        lock.release()


def _prepare(inputs, tokenizer, out, text_field, validation_fraction, workers, eos, force,
             progress) -> dict[str, Any]:  # fmt: skip
    val_out = validation_path(out) if validation_fraction > 0 else None
    targets = [p for p in (out, val_out) if p is not None]
    if not force:
        for p in targets:
            for q in (p, sidecar_path(p)):
                if q.exists():
                    raise ConfigError(f"--out={str(out)!r}: {q} exists (pass --force to replace)")
    tok = T.load(tokenizer, eos)
    if tok.eos_id is None:
        raise ConfigError(
            f"--tokenizer={tokenizer!r}: no end-of-text token found (tokenizer_config.json "
            "eos_token, config.json eos_token_id, or a known name); pass --eos TOKEN"
        )
    lock_file = out.with_name(out.name + ".lock")
    sources = list_sources(inputs, exclude=(*targets, lock_file))
    total = sum(s.path.stat().st_size for s in sources)
    dtype = token_dtype(tok.vocab_size)
    workers = workers or os.cpu_count() or 1
    writers = [_Writer(p, dtype) for p in targets]
    bar = _bar(total, progress)
    t0 = time.perf_counter()
    try:
        for (train, val, n_train, n_val), nbytes in _encoded(
            _chunks(documents(sources, text_field), validation_fraction), tokenizer, eos, workers
        ):
            writers[0].write(train, n_train)
            if val_out is not None:
                writers[1].write(val, n_val)
            if bar is not None:
                bar.update(nbytes)
        seconds = time.perf_counter() - t0
        _check_split(writers, validation_fraction)
        for w in writers:
            w.commit()
    except BaseException:
        for w in writers:
            w.abort()
        if bar is not None:
            bar.leave = False  # erase it: the error is the one line left
        raise
    finally:
        if bar is not None:
            bar.close()
    common = {
        "dtype": dtype,
        "vocab_size": tok.vocab_size,
        "tokenizer": tok.identity(),
        "eos_id": tok.eos_id,
        "validation_fraction": validation_fraction,
        "sources": list(inputs),
        "text_field": text_field if any(s.jsonl for s in sources) else None,
    }
    split = "train" if val_out is not None else "all"
    vname = val_out.name if val_out is not None else None
    for w, name in zip(writers, (split, "validation")[: len(writers)], strict=True):
        write_sidecar(
            w.path,
            {**common, "tokens": w.tokens, "documents": w.docs, "split": name,
             "validation_file": vname if name != "validation" else None},
        )  # fmt: skip
    return {
        "output": str(out),
        "validation_output": str(val_out) if val_out is not None else None,
        "tokens": writers[0].tokens,
        "documents": writers[0].docs,
        "validation_tokens": writers[1].tokens if val_out is not None else 0,
        "validation_documents": writers[1].docs if val_out is not None else 0,
        "files": len(sources),
        "input_bytes": total,
        "seconds": seconds,
        "mb_per_s": total / 1e6 / seconds if seconds > 0 else None,
        "workers": workers,
        **{k: common[k] for k in ("dtype", "vocab_size", "eos_id", "tokenizer")},
    }


def _check_split(writers: list[_Writer], fraction: float) -> None:
    docs = sum(w.docs for w in writers)
    if docs == 0:
        raise ConfigError("inputs: no documents found (empty or binary files only)")
    if len(writers) > 1 and writers[1].docs == 0:
        raise ConfigError(
            f"--validation-fraction={fraction}: {docs} documents hold out none (needs at least "
            f"{int(1 / fraction) + 1}); pass more documents or --validation-fraction 0"
        )


def _encoded(chunks, spec: str, eos: str | None, workers: int):
    """Encoded chunks in order: in this process for one worker, else a process pool with at most
    two chunks per worker in flight."""
    if workers == 1:
        _init_worker(spec, eos)
        for chunk, nbytes in chunks:
            yield _encode(chunk), nbytes
        return
    # fork is cheap and needs no importable __main__, but forking a process that runs JAX's
    # threads is unsafe: spawn then (the `jaxpar data` command never imports JAX).
    ctx = multiprocessing.get_context("spawn" if "jax" in sys.modules else "fork")
    with ProcessPoolExecutor(workers, ctx, _init_worker, (spec, eos)) as pool:
        pending: deque = deque()
        try:
            for chunk, nbytes in chunks:
                pending.append((pool.submit(_encode, chunk), nbytes))
                if len(pending) >= 2 * workers:
                    fut, n = pending.popleft()
                    yield fut.result(), n
            while pending:
                fut, n = pending.popleft()
                yield fut.result(), n
        except BrokenProcessPool as e:
            raise JaxparError(f"--workers={workers}: a tokeniser process died ({e})") from None
        finally:
            for fut, _ in pending:
                fut.cancel()


def _bar(total: int, enabled: bool):
    """A byte-count progress bar on stderr, when stderr is a terminal."""
    if not enabled or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="B", unit_scale=True, file=sys.stderr, dynamic_ncols=True)


def train_tokenizer(
    inputs: list[str],
    vocab_size: int,
    out: str | Path,
    text_field: str = "text",
    force: bool = False,
) -> dict[str, Any]:
    """Train a byte-level BPE on ``inputs`` (:func:`jaxpar.tokenizer.train_bpe`) into ``out``:
    written into a temporary directory of this run and moved into place whole, under
    ``out.lock``. An existing ``out`` is replaced only when it holds nothing but a tokenizer
    jaxpar wrote, or with ``force``."""
    out = Path(out)
    T.check_vocab_size(vocab_size)
    lock = output_lock(out, f"--out={str(out)!r}")
    try:
        _check_replaceable(out, T.TOKENIZER_FILES, force)
        sources = list_sources(inputs)
        t0 = time.perf_counter()
        tmp = temp_name(out)
        try:
            T.train_bpe((t for t, _ in documents(sources, text_field)), vocab_size, tmp)
            replace_dir(tmp, out)
        finally:
            if tmp.exists():
                import shutil

                shutil.rmtree(tmp, ignore_errors=True)
    finally:
        lock.release()
    tok = T.load(str(out))
    return {
        "output": str(out),
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "files": len(sources),
        "input_bytes": sum(s.path.stat().st_size for s in sources),
        "seconds": time.perf_counter() - t0,
        "sha256": tok.identity()["sha256"],
    }


def _check_replaceable(out: Path, own: tuple[str, ...], force: bool) -> None:
    """Refuse to replace ``out`` unless it is absent, an empty directory, or holds only files
    named ``own`` (what jaxpar writes there) — or ``force`` (then it is replaced whole)."""
    if not out.exists() or force:
        if out.exists() and not out.is_dir():
            raise ConfigError(f"--out={str(out)!r}: is a file, expected a directory")
        return
    if not out.is_dir():
        raise ConfigError(f"--out={str(out)!r}: is a file, expected a directory")
    foreign = sorted(p.name for p in out.iterdir() if p.name not in own)
    if foreign:
        raise ConfigError(
            f"--out={str(out)!r}: holds files jaxpar did not write ({', '.join(foreign[:3])}); "
            "pass --force to replace the directory whole"
        )
