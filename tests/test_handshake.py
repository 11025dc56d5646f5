"""Start-up handshake: draft and target agree on the model before they serve together.

The model identity is a hash of config.json and the tensors' names, dtypes and shapes, read from the
safetensors headers only. Target and draft exchange it with the contract version when their bridge
connects (a mismatch ends the bridge on both sides, naming both values), report it in GetInfo, and
the gateway refuses to serve unless both report the same — the error names both sides.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from cluster import Cluster, ClusterError, make_checkpoint
from bridge_checks import channel_pair, close_channels  # noqa: F401 (close_channels: autouse)
from services.bridge.rows import CONTRACT_VERSION
from services.identity import model_identity, safetensors_header, weight_files


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("hs") / "tiny", seed=3)


def variant(src, dst, config_change: dict | None = None):
    """A copy of checkpoint src, config.json changed by config_change."""
    shutil.copytree(src, dst)
    if config_change:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config_change}, indent=2))
    return dst


def identity(path) -> str:
    model_identity.cache_clear()
    return model_identity(str(path))


# --- the identity ---------------------------------------------------------------------------------
def test_identity_covers_config_and_tensor_shapes_not_formatting(ckpt, tmp_path):
    base = identity(ckpt)
    assert base.startswith("sha256:") and len(base) == 7 + 16
    same = variant(ckpt, tmp_path / "same")
    cfg = json.loads((same / "config.json").read_text())
    (same / "config.json").write_text(json.dumps(dict(reversed(list(cfg.items()))), indent=7))
    assert identity(same) == base, "key order and whitespace of config.json must not count"
    assert identity(variant(ckpt, tmp_path / "eps", {"rms_norm_eps": 1e-5})) != base
    reshaped = variant(ckpt, tmp_path / "reshaped")
    f = weight_files(reshaped)[0]
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(f))
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(*tensors[name].shape[:-1], tensors[name].shape[-1] + 1)
    save_file(tensors, str(f))
    assert identity(reshaped) != base


def test_identity_reads_headers_only(ckpt, tmp_path):
    """Every shard cut right after its header still hashes the same: no tensor byte is read."""
    cut = variant(ckpt, tmp_path / "cut")
    for f in weight_files(cut):
        n = int.from_bytes(f.read_bytes()[:8], "little")
        f.write_bytes(f.read_bytes()[: 8 + n])
        assert safetensors_header(f)
    assert identity(cut) == identity(ckpt)


# --- the bridge handshake -------------------------------------------------------------------------
def pair(target_hello: dict, draft_hello: dict):
    return channel_pair(target_hello, draft_hello, "gloo", "gloo")


def test_bridge_pairs_the_same_model():
    hello = {"model_identity": "sha256:aaaa", "contract_version": CONTRACT_VERSION}
    sender, receiver = pair(hello, dict(hello))
    assert sender.ready and receiver.ready, (sender.error, receiver.error)
    rows = torch.arange(6, dtype=torch.float32).view(2, 3)
    sender.send(7, rows)
    assert torch.equal(receiver.take(7, timeout_s=10), rows)


@pytest.mark.parametrize("field", ["model_identity", "contract_version"])
def test_bridge_refuses_a_different_model(field):
    target = {"model_identity": "sha256:aaaa", "contract_version": CONTRACT_VERSION}
    draft = {**target, field: "other-value"}
    sender, receiver = pair(target, draft)
    assert not sender.ready and not receiver.ready
    for ch in (sender, receiver):               # both sides name both values
        assert "not the same model" in ch.error and f"{field}: target {target[field]!r}, draft 'other-value'" \
            in ch.error, ch.error
    with pytest.raises(TimeoutError, match="not the same model"):
        receiver.take(1, timeout_s=1)          # the draft's Propose answers UNAVAILABLE with this message


# --- the whole cluster ------------------------------------------------------------------------------
@pytest.mark.slow
def test_gateway_refuses_a_draft_on_another_checkpoint(ckpt, tmp_path):
    other = variant(ckpt, tmp_path / "other", {"rms_norm_eps": 1e-5})
    t_id, d_id = identity(ckpt), identity(other)
    with pytest.raises(ClusterError) as e:
        with Cluster(ckpt, k=2, log_dir=tmp_path / "logs", drafts=[{"args": ["--model", str(other)]}]):
            pass
    msg = str(e.value)
    assert "gateway0-gloo exited with code 1 while starting" in msg, msg[-3000:]
    assert (f"refusing to serve: draft and target disagree on model_identity: target {t_id!r} "
            f"(--model {ckpt}), draft {d_id!r} (--model {other})") in msg, msg[-3000:]
    for name in ("target", "draft"):            # and the bridge refused to pair them, naming both
        log = (tmp_path / "logs" / f"{name}.log").read_text()
        assert f"model_identity: target {t_id!r}, draft {d_id!r}" in log, log[-2000:]
