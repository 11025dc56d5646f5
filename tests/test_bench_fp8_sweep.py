"""`tandem bench fp8-sweep --small` on CPU: the sweep's code path (candidates checked and timed, winners picked,
rows checked bit for bit, defaults fitted, the config module written) on two tiny shapes with the Triton kernels
interpreted (TRITON_INTERPRET=1, set here before triton is imported); the GPU run is .gpu/fp8_sweep.sh."""
import importlib.util
import json
import os
import sys

import pytest
import torch

CUDA = torch.cuda.is_available()
LATE = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
if not CUDA and not LATE:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton", reason="triton is not installed (pip install '.[test]')")

from kernels import triton_fp8_config as fcfg  # noqa: E402
from tandem.bench import main as bench_main  # noqa: E402


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the --small sweep interprets the kernels on CPU")
def test_fp8_sweep_writes_tables_and_a_config_module_that_loads(tmp_path):
    assert bench_main(["fp8-sweep", "--device", "cpu", "--small", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "fp8_sweep.json").read_text())
    md = (tmp_path / "fp8_sweep.md").read_text()
    assert "## Winners" in md and "Rows bit-identical within their class" in md and "True (4/4" in md
    assert "one MMA kind and one split a shape): True (4/4" in md
    spec = importlib.util.spec_from_file_location("fp8_config_swept", tmp_path / "fp8_config.py")
    swept = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(swept)
    assert set(swept.TABLE) == {(128, 400), (64, 256)}
    for res in data["results"]:
        N, K = res["shape"][2:]
        assert set(res["rows"]) == {"1", "3", "16"} and all(r["fp8_us"] > 0 for r in res["rows"].values())
        first = res["winners"]["8"]
        for cls, win in res["winners"].items():
            searched = res["rows"]["1" if cls == "8" else "16"]["candidates"]
            assert win["kind"] == "triton" and win["rows_agree"] and win["rows_across"]
            assert len(searched) >= (3 if cls == "8" else 1)
            if cls != "8":                                  # bound by class 1..8: its MMA kind, its split
                assert all(c["split"] == first["split"] and fcfg.wgmma(fcfg.Tile(*c["tile"])) ==
                           fcfg.wgmma(fcfg.Tile(*first["tile"])) for c in searched), searched
            assert win["us"] == min(c["us"] for c in searched)              # the fastest candidate won
            cfg = swept.TABLE[(N, K)][int(cls)]
            assert list(cfg.tile) == win["tile"] and cfg.split == win["split"]
    assert swept.lookup(128, 400, 3) == swept.TABLE[(128, 400)][8]             # the table drives the kernel
    assert swept.DEFAULTS[8][0] in swept.TILES and swept.DEFAULTS[32] == fcfg.DEFAULTS[32]      # 32: not measured
