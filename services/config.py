"""ServiceConfig: the one typed config of a target or draft process, parsed and validated at start."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_PORTS = {"target": 50052, "draft": 50053}


@dataclass(frozen=True)
class ServiceConfig:
    role: str                        # target | draft
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 0
    bridge_addr: str = "127.0.0.1:29650"
    hidden_transport: str = "auto"   # auto | gloo | nccl | inline
    num_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = 4096
    threads: int = 1                 # torch CPU threads (one per process keeps a local cluster calm)
    bridge_timeout_s: float = 10.0   # draft: how long Propose waits for a bridge frame

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def bridge_backend(self) -> str | None:
        """None: inline rows only. auto: NCCL between GPUs, gloo on CPU."""
        if self.hidden_transport == "inline":
            return None
        if self.hidden_transport == "auto":
            return "nccl" if self.device.startswith("cuda") else "gloo"
        return self.hidden_transport

    def validate(self) -> "ServiceConfig":
        def need(ok, msg):
            if not ok:
                raise SystemExit(f"tandem {self.role}: {msg}")
        need(self.dtype in DTYPES, f"--dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        need(self.hidden_transport in ("auto", "gloo", "nccl", "inline"),
             f"--hidden-transport must be auto|gloo|nccl|inline, got {self.hidden_transport!r}")
        need(not self.device.startswith("cuda") or torch.cuda.is_available(), "--device cuda but CUDA is not available")
        need(self.bridge_backend != "nccl" or self.device.startswith("cuda"), "--hidden-transport nccl needs --device cuda")
        need(self.num_blocks > 0 and self.block_size > 0, "--num-blocks and --block-size must be > 0")
        need(":" in self.bridge_addr, f"--bridge-addr must be host:port, got {self.bridge_addr!r}")
        return self


def parse(role: str, argv, description: str) -> ServiceConfig:
    from tandem.cli import default_model
    p = argparse.ArgumentParser(prog=f"tandem {role}", description=description)
    flags = {"port": "--grpc-port"}
    for f in fields(ServiceConfig):
        if f.name == "role":
            continue
        default = DEFAULT_PORTS[role] if f.name == "port" else (None if f.name == "model" else f.default)
        p.add_argument(flags.get(f.name, "--" + f.name.replace("_", "-")), dest=f.name, default=default,
                       type=type(f.default) if f.name != "model" else str)
    a = p.parse_args(argv)
    return ServiceConfig(role=role, **{**vars(a), "model": str(a.model or default_model())}).validate()


def setup_torch(cfg: ServiceConfig) -> None:
    if cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    else:
        torch.cuda.set_device(torch.device(cfg.device))
