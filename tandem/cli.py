"""`tandem` command line: one subcommand per role; each builds its typed config and hands over."""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from infra.defaults import DIE_WITH_PARENT
from infra.help import DefaultsHelp


def _make_tiny(args) -> int:
    from models.tiny import make_tiny
    print(make_tiny(args.out_dir, seed=args.seed))
    return 0


def _generate(args) -> int:
    import torch
    from tokenizers import Tokenizer
    from models.loader import load_model
    from models.model import TargetModel
    from models.runner import greedy_generate
    from models.tiny import default_model
    path = Path(args.model or default_model())
    if not (path / "config.json").exists() or not (path / "tokenizer.json").exists():
        raise SystemExit(f"tandem generate: --model {path}: not a checkpoint (config.json and tokenizer.json)")
    if not args.prompt:
        raise SystemExit("tandem generate: --prompt is empty")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit(f"tandem generate: --device {args.device}: this machine's torch sees no CUDA device")
    if args.threads < 1:
        raise SystemExit(f"tandem generate: --threads must be >= 1, got {args.threads}")
    torch.set_num_threads(args.threads)           # torch's default (every core) crawls on a busy small machine
    model = load_model(TargetModel, path, dtype=torch.float32, device=args.device)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    ids = tok.encode(args.prompt).ids
    room = model.cfg.max_position_embeddings - len(ids)
    if not 1 <= args.max_tokens <= room:
        raise SystemExit(f"tandem generate: --max-tokens must be in 1..{room} (the prompt has {len(ids)} tokens of "
                         f"the model's {model.cfg.max_position_embeddings}), got {args.max_tokens}")
    out = greedy_generate(model, ids, args.max_tokens)
    print(args.prompt + tok.decode(out))
    return 0


def _own_kernels() -> None:
    """Exit naming the clash when `import kernels` finds another package than this repo's kernels/ (Hugging
    Face's `kernels` distribution, which transformers >= 5.25 requires, has the same import name)."""
    import importlib.util
    spec = importlib.util.find_spec("kernels")
    origin = spec.origin if spec else None
    if origin is None or Path(origin).resolve().parent != Path(__file__).resolve().parent.parent / "kernels":
        raise SystemExit(f"tandem: `import kernels` finds {origin}, not Tandem's kernels/ package "
                         f"({Path(__file__).resolve().parent.parent / 'kernels'}): Hugging Face's `kernels` "
                         "distribution (required by transformers >= 5.25) has the same import name; serve Tandem "
                         "from an environment without it (pip uninstall kernels)")


def _die_with_parent() -> None:
    """Started by `tandem serve` (or a service's rank 0: the variable is inherited): SIGTERM when the process that
    started this one dies, even killed with SIGKILL, so nothing is left holding the cluster's ports (Linux)."""
    if os.environ.get(DIE_WITH_PARENT) != "1" or not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal
    parent = os.getppid()
    signal.signal(signal.SIGINT, signal.SIG_IGN)                   # Ctrl-C is the supervisor's (it stops us in order)
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)    # PR_SET_PDEATHSIG
    if os.getppid() != parent:                                     # it died before the line above
        raise SystemExit("tandem: the process that started this one has exited")


def main(argv: list[str] | None = None) -> int:
    _own_kernels()
    _die_with_parent()
    import faulthandler
    import signal
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 PID`: every thread's stack on stderr, even
                                                             # with the GIL held (no Python code runs to write it)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    level = os.environ.get("TANDEM_LOG_LEVEL", "INFO").upper()   # Tandem's own loggers (DEBUG: the adaptive
    if level in logging.getLevelNamesMapping():                  # policy's choice and outcome a round)
        logging.getLogger("tandem").setLevel(level)
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("make-tiny", help="write a small random checkpoint with one MTP layer")
    s.add_argument("out_dir")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(fn=_make_tiny)
    s = sub.add_parser("generate", help="greedy generation in this process (no services)",
                       formatter_class=DefaultsHelp)
    s.add_argument("--model", help="checkpoint dir (default: the bundled model)")
    s.add_argument("--prompt", default="def fibonacci(n):\n", help="text to continue")
    s.add_argument("--max-tokens", type=int, default=32, help="tokens to generate")
    s.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model runs")
    s.add_argument("--threads", type=int, default=1, help="torch CPU threads (as the services)")
    s.set_defaults(fn=_generate)
    for name, module in (("serve", "tandem.serve"), ("target", "services.target.server"),
                         ("draft", "services.draft.server"), ("gateway", "gateway.server"),
                         ("train", "tandem.train"), ("corpus", "tandem.corpus"), ("bench", "tandem.bench")):
        s = sub.add_parser(name, help=f"see `tandem {name} --help`", add_help=False)
        s.set_defaults(module=module)
    args, rest = p.parse_known_args(argv)
    if hasattr(args, "module"):
        import importlib
        return importlib.import_module(args.module).main(rest)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
