"""`tandem bench rows` on CPU: the probe's hooks, its comparison and its report; a verify of one row (no drafts)
against the decode must find no difference (the probe itself is deterministic), one request or several; nor may
a verify of 4 rows, in fp32 or fp8, the tiny model's or the bundled one's (one thread, as the services run: CPU
GEMMs of 1 to 3 rows run as 4, the router's elementwise work on whole vectors, kernels/rows.py)."""
import json

import pytest
import torch

from infra.paths import BUNDLED_MODEL
from tandem.bench import main as bench_main
from kernels.rows import cpu_gemm_rows
from tandem.bench_rows import compare

INVARIANT = pytest.mark.skipif(cpu_gemm_rows() == 1, reason="this CPU's GEMM gives a row other bits at every row "
                               "count probed (kernels/rows.cpu_gemm_rows): no batch invariance to check")


@INVARIANT
def test_bench_rows_reports_each_quantization_and_batch(tmp_path):
    out = tmp_path / "out"
    assert bench_main(["rows", "--device", "cpu", "--random-config", "tiny", "--quantization", "none,fp8",
                       "--drafts", "3", "--batches", "1,3", "--out", str(out)]) == 0
    r = json.loads((out / "rows.json").read_text())
    assert [(x["quantization"], x["batch"]) for x in r["runs"]] == [("none", 1), ("none", 3), ("fp8", 1), ("fp8", 3)]
    for run in r["runs"]:      # the tiny model's modules with a row a token (the MLA's latent write is one call)
        assert run["rows"] == 4 and run["compared"] > 15 and run["differ"] == [], run["differ"][:3]
    assert "| none | 3 | 4 | " in (out / "rows.md").read_text()


@INVARIANT
@pytest.mark.skipif(not (BUNDLED_MODEL / "config.json").exists(), reason=f"no bundled model at {BUNDLED_MODEL} (a "
                    "GPU machine given the tree without checkpoints/): the bench would measure the random tiny model")
def test_bench_rows_bundled_model_verify_rows_are_decode_rows(tmp_path):
    """The bundled model (20 layers, 8 experts: a [1, 8] router row once took other sigmoid bits than a [4, 8] one)."""
    assert bench_main(["rows", "--device", "cpu", "--batches", "1,2", "--out", str(tmp_path)]) == 0
    for run in json.loads((tmp_path / "rows.json").read_text())["runs"]:
        assert run["rows"] == 4 and run["compared"] > 100 and run["differ"] == [], run["differ"][:3]


def test_bench_rows_one_row_against_one_row_is_identical(tmp_path):
    assert bench_main(["rows", "--device", "cpu", "--random-config", "tiny", "--drafts", "0", "--batches", "1,3",
                       "--out", str(tmp_path)]) == 0
    for run in json.loads((tmp_path / "rows.json").read_text())["runs"]:
        assert run["rows"] == 1 and run["compared"] > 15 and run["differ"] == [], run["differ"][:3]


def test_compare_takes_each_requests_first_verify_row():
    decode = torch.arange(6.0).view(3, 2)                                 # 3 requests, a row each
    verify = torch.zeros(6, 2)                                            # 3 requests x 2 rows
    verify[::2] = decode
    assert compare([("m", decode)], [("m", verify)], 3, 2) == []
    verify[2, 1] += 1                                                     # request 1's first row
    assert compare([("m", decode)], [("m", verify)], 3, 2) == [{"module": "m", "max_abs_diff": 1.0, "rows_differ": 1}]
    assert compare([("grouped", torch.zeros(5, 2))], [("grouped", torch.ones(7, 2))], 3, 2) == []   # not a row a token


def test_cpu_gemm_rows_follows_the_thread_count():
    """The row class is probed per thread count: a process that changes its threads after its first GEMM (a bench
    run after another) must not keep the old count's class (16 on two threads here, 4 on one)."""
    from kernels.rows import _probe_rows
    before = torch.get_num_threads()
    try:
        for threads in (2, 1, 2):
            torch.set_num_threads(threads)
            assert cpu_gemm_rows() == _probe_rows(), threads
    finally:
        torch.set_num_threads(before)
