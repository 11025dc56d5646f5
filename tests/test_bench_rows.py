"""`tandem bench rows` on CPU: the probe's hooks, its comparison and its report; a verify of one row (no drafts)
against the decode must find no difference (the probe itself is deterministic)."""
import json

from tandem.bench import main as bench_main


def test_bench_rows_reports_each_quantization(tmp_path):
    out = tmp_path / "out"
    assert bench_main(["rows", "--device", "cpu", "--random-config", "tiny", "--quantization", "none,fp8",
                       "--drafts", "3", "--out", str(out)]) == 0
    r = json.loads((out / "rows.json").read_text())
    assert [x["quantization"] for x in r["runs"]] == ["none", "fp8"]
    for run in r["runs"]:
        assert run["rows"] == 4 and run["compared"] > 20
        assert all(d["module"] and (d["max_abs_diff"] is None or d["max_abs_diff"] > 0) for d in run["differ"]), run
    assert "| none | 4 |" in (out / "rows.md").read_text()


def test_bench_rows_one_row_against_one_row_is_identical(tmp_path):
    assert bench_main(["rows", "--device", "cpu", "--random-config", "tiny", "--drafts", "0",
                       "--out", str(tmp_path)]) == 0
    run = json.loads((tmp_path / "rows.json").read_text())["runs"][0]
    assert run["rows"] == 1 and run["compared"] > 20 and run["differ"] == [], run["differ"][:3]
