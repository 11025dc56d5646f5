"""`tandem train`'s data: the stdlib split by file, training-only extra code, token streams, batches, bytes.

The held-out set is a seeded 5 % of the --corpus (stdlib) files by file; --extra files (`tandem corpus`'s
extra/ part: installed packages' code, stdlib copies removed) only ever train. The tokenizer is trained on the
stdlib training files alone; the training stream is the stdlib training files --corpus-repeat times, then
the extra files, each file's tokens followed by </s>.
"""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

from tandem.corpus import stdlib_files

EOS = 2


def split_corpus(root: Path, seed: int, heldout_frac: float, max_files: int = 0) -> tuple[list[str], list[str]]:
    # the stdlib's .py files as sorted relative posix paths -> (train, held-out), split by a seeded shuffle
    files = stdlib_files(root)
    files = files[:max_files] if max_files else files
    order = list(range(len(files)))
    random.Random(seed).shuffle(order)
    held = set(order[: max(1, round(heldout_frac * len(files)))])
    return [f for i, f in enumerate(files) if i not in held], [f for i, f in enumerate(files) if i in held]


def extra_files(root: Path) -> list[str]:
    # every .py under root (sorted relative posix paths), below 1 MiB
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if p.is_file() and p.stat().st_size < 1 << 20)


def token_stream(tok, root: Path, files: list[str], batch: int = 512) -> torch.Tensor:
    # -> [n_tokens] int64: each file's tokens followed by </s> (encode_batch_fast: the same ids without offsets)
    parts, encode = [], getattr(tok, "encode_batch_fast", tok.encode_batch)
    for i in range(0, len(files), batch):
        texts = [(root / f).read_text(errors="ignore") for f in files[i: i + batch]]
        parts += [torch.tensor(e.ids + [EOS], dtype=torch.long) for e in encode(texts)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def prepare_data(c, out: Path, reuse_tokenizer: bool, pre_tokenizer=None):
    """c: TrainConfig -> train stream [N_train], held-out stream [N_held] (on c.device), corpus info, bytes per
    token id [V]; writes heldout_files.json and (unless reused) the tokenizer into out."""
    import os

    from tokenizers import Tokenizer

    from models.tiny import train_tokenizer
    root = Path(c.corpus or Path(os.__file__).parent)
    train_files, held_files = split_corpus(root, c.seed, c.heldout_frac, c.max_files)
    extra_root = Path(c.extra) if c.extra else None
    extra = extra_files(extra_root) if extra_root else []
    (out / "heldout_files.json").write_text(json.dumps(dict(
        root=str(root), python=sys.version.split()[0], seed=c.seed, fraction=c.heldout_frac,
        n_train_files=len(train_files), n_heldout_files=len(held_files), files=held_files), indent=1))
    if not (reuse_tokenizer and (out / "tokenizer.json").exists()):
        train_tokenizer(((root / f).read_text(errors="ignore") for f in train_files), c.arch["vocab_size"], out,
                        pre_tokenizer)
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    std_ids, held_ids = (token_stream(tok, root, fs) for fs in (train_files, held_files))
    extra_ids = token_stream(tok, extra_root, extra) if extra else torch.zeros(0, dtype=torch.long)
    train_ids = torch.cat([std_ids] * c.corpus_repeat + [extra_ids]).to(c.device)
    info = dict(root=str(root), python=sys.version.split()[0], train_files=len(train_files),
                heldout_files=len(held_files), stdlib_train_tokens=std_ids.numel(), corpus_repeat=c.corpus_repeat,
                extra=str(extra_root or ""), extra_files=len(extra), extra_tokens=extra_ids.numel(),
                train_tokens=train_ids.numel(), heldout_tokens=held_ids.numel(),
                heldout_bytes=sum(len((root / f).read_text(errors="ignore").encode()) for f in held_files))
    print(f"corpus: {info}", flush=True)
    return train_ids, held_ids.to(c.device), info, token_bytes(tok)


def sample_batch(stream: torch.Tensor, n: int, T: int, g: torch.Generator) -> torch.Tensor:
    # n random windows of the stream -> [n, T + 1] (g lives on the stream's device: no host sync)
    starts = torch.randint(0, stream.numel() - T - 1, (n, 1), generator=g, device=stream.device)
    return stream[starts + torch.arange(T + 1, device=stream.device)]


def token_bytes(tok) -> torch.Tensor:
    # -> [V] float: UTF-8 bytes each token stands for (byte-level BPE: one character per byte; specials 0)
    special = {t.content for t in tok.get_added_tokens_decoder().values()}
    return torch.tensor([0.0 if (s := tok.id_to_token(i)) is None or s in special else float(len(s))
                         for i in range(tok.get_vocab_size())])


def held_windows(held: torch.Tensor, T: int, n_seqs: int) -> list[torch.Tensor]:
    # [N] -> min(n_seqs, all) [T+1] windows, each predicting the T tokens after the last one's; n_seqs 0: all, and
    # the tail as a shorter window (unless it predicts one token only)
    n = (held.numel() - 1) // T
    full = [held[i * T: i * T + T + 1] for i in range(n) if i * T + T + 1 <= held.numel()]
    tail = held[len(full) * T:]
    return full[:n_seqs] if n_seqs else full + ([tail] if tail.numel() >= 3 else [])
