"""Load and save HF-layout checkpoints (config.json + safetensors, single file or sharded with an index).

Reads only the tensors (and, for split weights, only the slices) this process keeps. Accepts routed
experts per expert (`mlp.experts.{e}.gate_proj.weight`, DeepSeek's layout) or fused as transformers 5
writes them (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first; `mlp.experts.down_proj` [E, H, I]),
and fp8 e4m3 weights with 128x128 block scales (`*.weight_scale_inv`), dequantized at load.
"""
from __future__ import annotations

import json
import logging
import re
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.config import ModelConfig
from models.parallel import ParallelState, SINGLE

log = logging.getLogger("tandem.loader")
FP8_BLOCK = 128
_FUSED = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


class CheckpointError(ValueError):
    """A checkpoint tensor is missing, mis-shaped, or the directory is not a checkpoint."""


class MissingTensor(KeyError):
    """One tensor a parameter needs is not in the checkpoint (load_weights reports all of them at once)."""


class Checkpoint:
    """Index of a checkpoint directory: which shard file holds which tensor."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            self.files = {name: self.path / f for name, f in weight_map.items()}
        else:
            shards = sorted(self.path.glob("*.safetensors"))
            if not shards:
                raise CheckpointError(f"no model.safetensors or *.safetensors files in {self.path}")
            self.files = {}
            for f in shards:
                with safe_open(f, "pt") as h:
                    self.files.update({name: f for name in h.keys()})
        self._open: dict[Path, object] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def _handle(self, name: str):
        f = self.files[name]
        if f not in self._open:
            self._open[f] = safe_open(f, "pt")
        return self._open[f]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(name).get_slice(name).get_shape())

    def read(self, name: str, index=None) -> torch.Tensor:
        """The tensor, or `index` of it (a tuple of ints/slices), dequantized if fp8."""
        sl = self._handle(name).get_slice(name)
        if sl.get_dtype() in ("F8_E4M3", "F8_E5M2"):
            scale_name = name + "_scale_inv"
            if scale_name not in self.files:
                raise CheckpointError(f"{name} is fp8 but {scale_name} is missing")
            t = dequantize_fp8(self._handle(name).get_tensor(name), self._handle(scale_name).get_tensor(scale_name))
            return t[index] if index is not None else t
        return sl[index] if index is not None else sl[:]

    def close(self):
        self._open.clear()


def dequantize_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    # w: [..., O, I] fp8, scale_inv: [..., ceil(O/b), ceil(I/b)] -> fp32 w * scale per 128x128 block
    O, I = w.shape[-2:]
    s = scale_inv.float().repeat_interleave(block, -2)[..., :O, :].repeat_interleave(block, -1)[..., :I]
    return w.float() * s


def quantize_fp8(w: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 as DeepSeek publishes V3 (used by tests and tools, not by serving)."""
    O, I = w.shape
    pad = torch.zeros(-(-O // block) * block, -(-I // block) * block)
    pad[:O, :I] = w.float()
    blocks = pad.view(pad.shape[0] // block, block, pad.shape[1] // block, block)
    scale = blocks.abs().amax((1, 3)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[:, None, :, None]).view_as(pad)[:O, :I].to(torch.float8_e4m3fn)
    return q, scale.float()


def _shard_index(shard, full_shape, lead=()):
    if shard is None:
        return lead + (slice(None),)
    dim, rank, size = shard
    part = full_shape[dim] // size
    idx = [slice(None)] * len(full_shape)
    idx[dim] = slice(rank * part, (rank + 1) * part)
    return lead + tuple(idx)


def load_weights(model: torch.nn.Module, path: str | Path) -> dict:
    """Fill every parameter of `model` from the checkpoint. Returns {"loaded": n, "unused": [...]}."""
    ckpt = Checkpoint(path)
    used: set[str] = set()
    params = dict(model.named_parameters())
    missing = []
    with torch.no_grad():
        for name, p in params.items():
            try:
                t, src = _read_param(ckpt, model.checkpoint_names(name), p)
            except MissingTensor as e:
                missing.append(e.args[0])
                continue
            used.update(src)
            p.copy_(t)
    ckpt.close()
    if missing:       # all of them, named: a V3.2 config over a checkpoint without indexers lists every one
        many = f"{len(missing)} tensors the model needs: " if len(missing) > 1 else ""
        raise CheckpointError(f"checkpoint {path} is missing {many}" + ", ".join(missing[:12])
                              + (" ..." if len(missing) > 12 else ""))
    unused = sorted(n for n in ckpt.files if n not in used and model.owns_checkpoint_name(n)
                    and not n.endswith("_scale_inv") and not _other_rank_expert(n, model.cfg.n_routed_experts))
    if unused:
        log.warning("checkpoint %s has %d tensors this model does not use (ignored): %s%s", path,
                    len(unused), ", ".join(unused[:8]), " ..." if len(unused) > 8 else "")
    return {"loaded": len(params), "unused": unused}


def _other_rank_expert(name: str, num_experts: int) -> bool:
    # a routed expert this model has but another EP rank holds; an index past n_routed_experts is unknown
    m = _FUSED.match(name)
    return bool(m) and int(m.group(2)) < num_experts


def _read_param(ckpt: Checkpoint, candidates: list[str], p) -> tuple[torch.Tensor, list[str]]:
    full = p.full_shape
    for name in candidates:
        if name in ckpt:
            _check_shape(name, full, ckpt.shape(name))
            return ckpt.read(name, _shard_index(p.shard, full)), [name]
    m = _FUSED.match(candidates[0])
    if m:
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        fused = f"{prefix}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"
        if fused in ckpt:
            shape = ckpt.shape(fused)
            if kind == "down_proj":
                _check_shape(fused, (shape[0],) + full, shape)
                return ckpt.read(fused, _shard_index(p.shard, full, (e,))), [fused]
            inter = full[0]
            _check_shape(fused, (shape[0], 2 * inter, full[1]), shape)
            t = ckpt.read(fused, (e,))[: inter] if kind == "gate_proj" else ckpt.read(fused, (e,))[inter:]
            return t[_shard_index(p.shard, full)], [fused]
    raise MissingTensor(f"tensor {candidates[0]} (expected shape {list(full)})")


def _check_shape(name, expected, actual):
    if tuple(expected) != tuple(actual):
        raise CheckpointError(f"tensor {name} has shape {list(actual)}, expected {list(expected)}")


@contextmanager
def _default(dtype: torch.dtype, device):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            yield
    finally:
        torch.set_default_dtype(old)


def build(cls, cfg: ModelConfig, ps: ParallelState = SINGLE, dtype=torch.float32, device="cpu"):
    """Construct `cls(cfg, ps)` directly on `device` in `dtype` (weights uninitialized)."""
    with _default(dtype, device):
        model = cls(cfg, ps)
    return model.eval()


def load_model(cls, path: str | Path, ps: ParallelState = SINGLE, dtype=torch.float32, device="cpu"):
    cfg = ModelConfig.from_file(path)
    model = build(cls, cfg, ps, dtype, device)
    load_weights(model, path)
    return model


def save_checkpoint(tensors: dict[str, torch.Tensor], path: str | Path, max_shard_bytes: int = 16 << 20):
    """Write safetensors shards of at most `max_shard_bytes` and, if more than one, the index."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shards, cur, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if cur and size + nbytes > max_shard_bytes:
            shards.append(cur)
            cur, size = {}, 0
        cur[name], size = t.detach().contiguous().cpu(), size + nbytes
    shards.append(cur)
    if len(shards) == 1:
        save_file(shards[0], path / "model.safetensors", metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / fname, metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))


def checkpoint_tensors(*models: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State of single-rank models under their checkpoint names (first candidate), deduplicated."""
    out = {}
    for m in models:
        for name, t in m.state_dict().items():
            out.setdefault(m.checkpoint_names(name)[0], t)
    return out
