"""Load and save HF-layout checkpoints (config.json + safetensors, single file or sharded with an index).

Reads only the tensors (and, for split weights, only the slices) this process keeps. Accepts routed
experts per expert (`mlp.experts.{e}.gate_proj.weight`, DeepSeek's layout) or fused as transformers 5
writes them (`mlp.experts.gate_up_proj` [E, 2I, H], gate rows first; `mlp.experts.down_proj` [E, H, I]),
and fp8 e4m3 weights with 128x128 block scales (`*.weight_scale_inv`): copied as they are into a model that keeps
fp8 weights (ModelConfig.quantization "fp8": no wider copy of them is ever made, on the host or the device),
dequantized at load into one that does not. A model that keeps fp8 but reads a wider checkpoint (--quantization
fp8 over bf16) quantizes each weight on its own device as it lands (kernels/fp8.quantize_weight).
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

from kernels.fp8 import FP8, dequantize_weight, quantize_weight
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

    def is_fp8(self, name: str) -> bool:
        return self._handle(name).get_slice(name).get_dtype() in ("F8_E4M3", "F8_E5M2")

    def read(self, name: str, index=None, raw: bool = False) -> torch.Tensor:
        """The tensor, or `index` of it (a tuple of ints/slices), dequantized if fp8 (raw: as stored)."""
        sl = self._handle(name).get_slice(name)
        if not raw and sl.get_dtype() in ("F8_E4M3", "F8_E5M2"):
            scale_name = name + "_scale_inv"
            if scale_name not in self.files:
                raise CheckpointError(f"{name} is fp8 but {scale_name} is missing")
            t = dequantize_weight(self._handle(name).get_tensor(name), self._handle(scale_name).get_tensor(scale_name))
            return t[index] if index is not None else t
        return sl[index] if index is not None else sl[:]

    def close(self):
        self._open.clear()


dequantize_fp8, quantize_fp8 = dequantize_weight, quantize_weight     # DeepSeek's format (kernels/fp8.py)


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
            if name.endswith(".weight_scale_inv"):                  # filled with its weight
                continue
            try:
                if p.dtype == FP8:
                    src = _load_fp8(ckpt, model.checkpoint_names(name), p, params[name + "_scale_inv"])
                else:
                    t, src = _read_param(ckpt, model.checkpoint_names(name), p)
                    p.copy_(t)
            except MissingTensor as e:
                missing.append(e.args[0])
                continue
            used.update(src)
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


def _load_fp8(ckpt: Checkpoint, candidates: list[str], p, scale) -> list[str]:
    """Fill fp8 weight p and its block scales: an fp8 checkpoint tensor is copied as stored (this rank's slice,
    whole 128x128 blocks); a wider one is quantized on p's device, one tensor at a time."""
    for name in candidates:
        if name in ckpt and ckpt.is_fp8(name):
            _check_shape(name, p.full_shape, ckpt.shape(name))
            sname = name + "_scale_inv"
            if sname not in ckpt:
                raise CheckpointError(f"{name} is fp8 but {sname} is missing")
            _check_shape(sname, scale.full_shape, ckpt.shape(sname))
            p.copy_(ckpt.read(name, _shard_index(p.shard, p.full_shape), raw=True))
            scale.copy_(ckpt.read(sname, _shard_index(scale.shard, scale.full_shape), raw=True))
            return [name, sname]
    t, src = _read_param(ckpt, candidates, p)
    q, s = quantize_weight(t.to(p.device))
    p.copy_(q)
    scale.copy_(s)
    return src


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


def load_model(cls, path: str | Path, ps: ParallelState = SINGLE, dtype=torch.float32, device="cpu",
               quantization: str = "auto"):
    """cls of the checkpoint at `path`; quantization (models/config.QUANTIZATIONS) overrides its own format."""
    cfg = ModelConfig.from_file(path).quantized(quantization, device)
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
        t = t.detach().contiguous().cpu()
        if t.untyped_storage().nbytes() != nbytes:          # a view into stacked weights (a MoE's w13, an MLP's
            t = t.clone()                                  # gate | up): its own storage, as safetensors needs
        cur[name], size = t, size + nbytes
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


def fp8_weight_names(cfg: ModelConfig) -> set[str]:
    """Checkpoint names of the weights a model of cfg keeps in fp8 (quantization fp8), its MTP layer's too (built
    on the meta device: no memory)."""
    from models.model import DraftModel, TargetModel
    models = [build(cls, cfg.quantized("fp8"), SINGLE, torch.bfloat16, "meta") for cls in (TargetModel, DraftModel)]
    return {n.removesuffix("_scale_inv") for n in checkpoint_tensors(*models) if n.endswith("_scale_inv")}


def checkpoint_tensors(*models: torch.nn.Module) -> dict[str, torch.Tensor]:
    """State of single-rank models under their checkpoint names (first candidate), deduplicated."""
    out = {}
    for m in models:
        for name, t in m.state_dict().items():
            out.setdefault(m.checkpoint_names(name)[0], t)
    return out
