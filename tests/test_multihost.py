"""A target whose ranks live on two "hosts" (issue 16, item 4): separate process trees that know each other only
through the rendezvous address, as torch.distributed's env:// launchers start them (torchrun, the Kubernetes
StatefulSet in deploy/). Rank 1 is started first, on its own, with nothing but MASTER_ADDR / MASTER_PORT /
RANK / WORLD_SIZE; rank 0 serves gRPC for the gateway; greedy output through the gateway equals the
single-process model's. Then the flags that build such launches: --local-ranks and bad env:// settings."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from cluster import REPO, Cluster, free_ports, make_checkpoint
from models.loader import load_model
from models.model import TargetModel
from models.runner import greedy_generate
from tandem.v1 import generate_pb2 as gen

pytestmark = pytest.mark.slow
PROMPTS = [[5, 9, 17, 33, 65], [300, 301, 302], [7] * 9]


def rank_env(rank: int, port: int) -> dict:
    return {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank), "WORLD_SIZE": "2",
            "LOCAL_RANK": "0"}


def test_target_ranks_on_two_hosts_meet_through_the_rendezvous_address(tmp_path):
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=11)
    port = free_ports(1)[0]
    log = open(tmp_path / "host2-rank1.log", "wb")
    # "host 2": its own process, no gRPC port, no bridge, no parent: only the rendezvous address
    host2 = subprocess.Popen([sys.executable, "-m", "tandem", "target", "--model", str(ckpt), "--device", "cpu",
                              "--threads", "1", "--num-blocks", "1024", "--dist-addr", "env://"], cwd=REPO,
                             env={**os.environ, "OMP_NUM_THREADS": "1", **rank_env(1, port)}, stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
    try:
        with Cluster(ckpt, k=3, targets=[{"args": ["--dist-addr", "env://"], "env": rank_env(0, port)}]) as c:
            stub = c.gateways[0].stub
            ref = load_model(TargetModel, ckpt)
            torch.set_num_threads(1)
            for prompt in PROMPTS:
                req = gen.GenerateRequest(max_tokens=12, ignore_eos=True)
                req.token_ids.ids.extend(prompt)
                got = stub.Generate(req, timeout=120)
                assert list(got.token_ids) == greedy_generate(ref, prompt, 12), prompt
            assert got.spec_stats.num_drafts > 0                      # speculation ran over the two-host target
            assert host2.poll() is None, (tmp_path / "host2-rank1.log").read_text()[-3000:]
            assert "rank 0/2 joined (gloo)" in c.proc("target").log.read_text()
        host2.wait(timeout=60)                                         # rank 0 gone: the other host's rank exits
        assert "rank 1/2 joined (gloo)" in (tmp_path / "host2-rank1.log").read_text()
    finally:
        if host2.poll() is None:
            host2.kill()
        log.close()


@pytest.mark.parametrize("env,flags,message", [
    ({"MASTER_ADDR": "", "RANK": "1", "WORLD_SIZE": "2"}, ["--dist-addr", "env://"], "needs MASTER_ADDR, MASTER_PORT"),
    ({"MASTER_ADDR": "h0", "MASTER_PORT": "1", "RANK": "0", "WORLD_SIZE": "4"}, ["--dist-addr", "env://", "--tp", "2"],
     "--tp 2 but WORLD_SIZE=4"),
    ({}, ["--tp", "2", "--local-ranks", "3"], "--local-ranks must be in [0, --tp 2], got 3"),
])
def test_bad_rendezvous_settings_are_named(env, flags, message):
    clean = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "tandem", "target", "--device", "cpu", *flags], cwd=REPO,
                         env={**clean, **{k: v for k, v in env.items() if v}}, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and message in out.stderr, out.stderr[-2000:]
    assert time.monotonic() - t0 < 60                                  # refused at once, not after a rendezvous wait
