"""lm-eval's `local-completions` model against the REST API of the shared local cluster
(api_cluster.py): a generate_until task and a multiple_choice task (loglikelihood through the
server's /tokenize and echo + logprobs), both from local JSONL files in tests/lm_eval/, offline."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from cluster import REPO

pytestmark = pytest.mark.slow
TASKS = {"tandem_gen": 6, "tandem_mc": 6}          # task -> documents in its JSONL


def test_lm_eval_local_completions(api_cluster, tmp_path):
    out = tmp_path / "out"
    args = ",".join([f"base_url={api_cluster.url}/v1/completions", f"model={api_cluster.model_name}",
                     "tokenizer_backend=remote", "tokenized_requests=True", "num_concurrent=2", "max_retries=1",
                     "timeout=120", f"max_length={2048 - 8}"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
                           "--tasks", ",".join(TASKS), "--include_path", "tests/lm_eval", "--output_path", str(out),
                           "--log_samples"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    results = json.loads(max(out.rglob("results_*.json")).read_text())
    r = results["results"]
    assert 0.0 <= r["tandem_gen"]["exact_match,none"] <= 1.0
    for metric in ("acc,none", "acc_norm,none"):
        assert 0.0 <= r["tandem_mc"][metric] <= 1.0, r["tandem_mc"]
    assert {t: results["n-samples"][t]["effective"] for t in TASKS} == TASKS
    mc = [json.loads(line) for f in out.rglob("samples_tandem_mc_*.jsonl") for line in f.read_text().splitlines()]
    assert len(mc) == TASKS["tandem_mc"]
    for doc in mc:                     # one (loglikelihood, is_greedy) per choice, finite and <= 0
        lls = [float(resp[0][0]) for resp in doc["resps"]]        # the samples file keeps them as text
        assert len(lls) == 3 and all(math.isfinite(x) and x < 0 for x in lls), doc["resps"]
    gen = [json.loads(line) for f in out.rglob("samples_tandem_gen_*.jsonl") for line in f.read_text().splitlines()]
    assert len(gen) == TASKS["tandem_gen"] and all(isinstance(d["resps"][0][0], str) for d in gen)
