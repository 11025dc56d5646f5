"""`tandem bench heldout`: a checkpoint's held-out perplexity and bits per byte, as `tandem train` reports them.

Reads the held-out file list the checkpoint ships (heldout_files.json, paths relative to the stdlib root),
tokenizes those files with the checkpoint's own tokenizer (each file followed by </s>) and scores the whole
stream in windows of --seq-len + 1 tokens (every token after the first predicted once): main-model loss,
perplexity, bits per byte (total negative log-likelihood in bits / UTF-8 bytes of the predicted tokens,
comparable across tokenizers), top-1 accuracy, and the MTP layer's loss and top-1 accuracy on token t+2.

    tandem bench heldout --model checkpoints/tandem-code-mini --corpus /usr/lib/python3.11
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def main(argv=None) -> int:
    from tokenizers import Tokenizer

    from models.loader import load_model
    from models.model import DraftModel, TargetModel
    from models.tiny import default_model
    from tandem.train import TrainConfig
    from tandem.train_data import token_bytes, token_stream
    from tandem.train_model import evaluate
    p = argparse.ArgumentParser(prog="tandem bench heldout", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--corpus", default="", help="stdlib root the listed files are under (default: this Python's)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--max-windows", type=int, default=0, help="score only the first N windows (0: the whole stream)")
    p.add_argument("--out", default="", help="write the result as JSON here")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    model = Path(a.model or default_model())
    root = Path(a.corpus or Path(os.__file__).parent)
    listed = json.loads((model / "heldout_files.json").read_text())
    missing = [f for f in listed["files"] if not (root / f).exists()]
    if missing:
        raise SystemExit(f"tandem bench heldout: {len(missing)} of {len(listed['files'])} held-out files are not under "
                         f"{root} (e.g. {missing[0]}); pass --corpus, the stdlib root of CPython {listed.get('python')}")
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    held = token_stream(tok, root, listed["files"]).to(a.device)                 # [N]
    c = TrainConfig(seq_len=a.seq_len, micro_batch=a.micro_batch, device=a.device)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    target, draft = (load_model(cls, model, dtype=torch.float32, device=a.device) for cls in (TargetModel, DraftModel))
    t0 = time.time()
    r = evaluate(target, draft, held, c, a.max_windows, token_bytes(tok))
    r.update(model=str(model), files=len(listed["files"]), heldout_tokens=held.numel(), device=a.device,
             autocast=str(dtype).split(".")[-1], seconds=time.time() - t0,
             text_bytes=sum(len((root / f).read_text(errors="ignore").encode()) for f in listed["files"]))
    print(json.dumps(r, indent=1))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(r, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
