"""`tandem bench nextline`'s documents (the lm-eval run itself needs a served model: BENCHMARKS.md): cut at line
breaks from the held-out files, and never longer than the model's context allows (one prompt over it fails the
whole lm-eval run with a 400)."""
from pathlib import Path

from tokenizers import Tokenizer

from models.tiny import default_model
from tandem.bench_nextline import nextline_docs


def test_nextline_prompts_end_at_a_line_break_and_fit_the_token_cap():
    model = Path(default_model())
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    free = nextline_docs(model, 12, 6000, seed=3)
    capped = nextline_docs(model, 12, 6000, seed=3, max_prompt_tokens=200)
    assert max(len(tok.encode(d["prompt"]).ids) for d in free) > 200            # the cap has work to do
    for f, c in zip(free, capped):
        assert c["answer"] == f["answer"] and f["prompt"].endswith(c["prompt"])  # whole leading lines dropped
        assert c["prompt"].endswith("\n") and "\n" not in c["answer"] and c["answer"].strip()
        assert len(tok.encode(c["prompt"]).ids) <= 200
    assert nextline_docs(model, 12, 6000, seed=3, max_prompt_tokens=1 << 20) == free
