"""`tandem bench nextline`: next-line exact match on held-out code, measured by lm-eval against the server.

Writes an lm-eval generate_until task: --docs cuts at random line boundaries of the held-out files the model
card names (seeded), each prompt up to --prompt-chars of whole lines ending in "\\n", its target the next line
(without its "\\n"; blank next lines are skipped), greedy, stopped at "\\n". Then runs lm-eval's
`local-completions` model against a running gateway (--base-url) or a `tandem serve` it starts, and reports
exact match (generation == next line, indentation included).

    tandem bench nextline --docs 200 --out results/nextline
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

TASK = """task: tandem_nextline
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_tokens}
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def nextline_docs(model: Path, n: int, prompt_chars: int, seed: int, root: Path | None = None,
                  max_prompt_tokens: int = 0) -> list[dict]:
    """n (prompt ending in "\\n", next line) pairs from the held-out files listed in model/heldout_files.json;
    max_prompt_tokens > 0: whole leading lines dropped until the prompt has at most that many tokens (the model's
    context less the answer's room: one prompt over it would fail the whole lm-eval run)."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(model / "tokenizer.json")) if max_prompt_tokens else None
    root = root or Path(os.__file__).parent
    names = json.loads((model / "heldout_files.json").read_text())["files"]
    texts = [(root / f).read_text(errors="ignore") for f in names if (root / f).exists()]
    if not texts:
        raise SystemExit(f"tandem bench nextline: none of the held-out files of {model} is under {root}")
    rng, docs, seen = random.Random(seed), [], set()
    while len(docs) < n:
        f = rng.randrange(len(texts))
        lines = texts[f].splitlines(keepends=True)
        i = rng.randrange(1, len(lines)) if len(lines) > 1 else 0
        nxt = lines[i].rstrip("\n") if i else ""
        if not nxt.strip() or not lines[i].endswith("\n") or (f, i) in seen:
            continue
        seen.add((f, i))
        prompt, j = "", i
        while j > 0 and len(lines[j - 1]) + len(prompt) <= prompt_chars:
            prompt, j = lines[j - 1] + prompt, j - 1
        while tok is not None and prompt and len(tok.encode(prompt).ids) > max_prompt_tokens:
            prompt = prompt[prompt.find("\n") + 1:] if "\n" in prompt else ""
        if prompt:
            docs.append({"prompt": prompt, "answer": nxt})
    return docs


def run_lm_eval(base_url: str, model_name: str, task_dir: Path, out: Path, concurrency: int) -> dict:
    args = ",".join([f"base_url={base_url}/v1/completions", f"model={model_name}", "tokenizer_backend=remote",
                     "tokenized_requests=False", f"num_concurrent={concurrency}", "max_retries=1", "timeout=300"])
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args, "--tasks",
           "tandem_nextline", "--include_path", str(task_dir), "--output_path", str(out / "lm_eval"), "--log_samples"]
    print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"lm_eval failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return json.loads(max((out / "lm_eval").rglob("results_*.json")).read_text())


def main(argv=None) -> int:
    from models.tiny import default_model
    from tandem.bench import start_cluster, stop_cluster
    p = argparse.ArgumentParser(prog="tandem bench nextline", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--base-url", default=None, help="a running gateway's REST root (default: start tandem serve)")
    p.add_argument("--corpus", default="", help="stdlib root of the held-out files (default: this Python's)")
    p.add_argument("--docs", type=int, default=200)
    p.add_argument("--prompt-chars", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/nextline")
    a, extra = p.parse_known_args(argv)
    model, out = Path(a.model or default_model()), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    context = json.loads((model / "config.json").read_text()).get("max_position_embeddings", 2048)
    docs = nextline_docs(model, a.docs, a.prompt_chars, a.seed, Path(a.corpus) if a.corpus else None,
                         max_prompt_tokens=context - a.max_tokens - 16)      # 16: the drafts' headroom and more
    data = (out / "nextline.jsonl").resolve()
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    (out / "tandem_nextline.yaml").write_text(TASK.format(data=data, max_tokens=a.max_tokens))
    proc, base = None, a.base_url
    if base is None:
        proc, _, http = start_cluster(str(model), 3, extra)
        base = f"http://{http}"
    try:
        t0 = time.time()
        res = run_lm_eval(base, model.name, out, out, a.concurrency)
    finally:
        stop_cluster(proc)
    em = res["results"]["tandem_nextline"]["exact_match,none"]
    summary = dict(model=str(model), docs=len(docs), exact_match=em, seconds=time.time() - t0, seed=a.seed,
                   prompt_chars=a.prompt_chars, max_tokens=a.max_tokens, date=time.strftime("%Y-%m-%d"))
    (out / "nextline.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary, indent=1))
    return 0
