"""`tandem bench fp8 --small` on CPU: every part's code path (kernels, load, v2lite, v3, accuracy) in one quick run,
on the PyTorch reference; the GPU run (.gpu/issue15.sh) measures the same code at the real shapes."""
import json

from cluster import make_checkpoint
from tandem.bench import main as bench_main


def test_bench_fp8_runs_every_part_on_cpu(tmp_path):
    ckpt = make_checkpoint(tmp_path / "tiny", seed=4)
    assert bench_main(["fp8", "--device", "cpu", "--small", "--model", str(ckpt), "--out", str(tmp_path / "out")]) == 0
    r = json.loads((tmp_path / "out" / "fp8.json").read_text())
    md = (tmp_path / "out" / "fp8.md").read_text()
    assert all(f"## {h}" in md for h in ("fp8 kernels", "Loading", "V2-Lite", "DeepSeek-V3 shapes", "Accuracy"))
    assert {row["tokens"] for row in r["kernels"]} == {1, 4} and all(row["fp8_us"] > 0 for row in r["kernels"])
    kept, wide = r["load"]
    assert kept["weights_gb"] < 0.7 * wide["weights_gb"]
    v2 = r["v2lite"]
    assert {row["quantization"] for row in v2["rows"]} == {"none", "fp8"}
    assert all(row["weights_vs_bf16"] < 0.7 for row in v2["rows"] if row["quantization"] == "fp8")
    assert v2["k3_equals_k0"]["fp8 batch 1"] == v2["k3_equals_k0"]["none batch 1"] == v2["prompts"]   # lossless
    assert {(row["batch"], row["k"]) for row in r["v3"]["rows"]} == {(1, 0), (1, 3), (2, 0), (2, 3)}
    assert all(row["full_estimate_ms"] > 0 and row["floor_ms"] > 0 for row in r["v3"]["rows"])
    acc = r["accuracy"]
    assert 0 < acc["agreement"] <= 1 and set(acc) >= {"bf16", "fp8, MTP fp8", "fp8, MTP bf16"}
    for name in ("bf16", "fp8, MTP fp8", "fp8, MTP bf16"):
        assert acc[name]["mal"] >= 1 and acc[name]["ppl"] > 1 and acc[name]["k3_equals_k0"] == acc["prompts"]
