"""The command line as a new user meets it: every help shows its defaults, `tandem bench --help` lists the
benchmarks and exits 0, and the flag names vLLM and SGLang users type work as aliases."""
import subprocess
import sys

import pytest

from cluster import REPO


def tandem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tandem", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


def test_bench_help_lists_the_benchmarks_and_exits_0():
    r = tandem("bench", "--help")
    assert r.returncode == 0, r.stderr
    for name in ("acceptance", "speed", "inprocess", "bridge", "floor", "dsa"):
        assert f"\n  {name} " in r.stdout, r.stdout
    assert tandem("bench").returncode == 2 and tandem("bench", "nope").returncode == 2


@pytest.mark.parametrize("cmd, flag, default", [("serve", "--http-port", "8000"), ("gateway", "--grpc-port", "50051"),
                                                ("target", "--num-blocks", "2048"), ("draft", "--max-model-len", "4096")])
def test_help_shows_defaults(cmd, flag, default):
    r = tandem(cmd, "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert flag in text and f"(default: {default})" in text, r.stdout


def test_vllm_and_sglang_flag_names():
    from services.config import parse
    from tandem import serve
    a = serve.parse(["--tensor-parallel-size", "2", "--port", "9000", "--random-config", "tiny"])
    assert (a.tp, a.http_port) == (2, 9000)
    assert serve.parse(["--tp-size", "2", "--random-config", "tiny"]).tp == 2
    assert parse("target", ["--tensor-parallel-size", "2", "--random-config", "tiny"], "").tp == 2
    from gateway.config import parse as gateway_parse
    assert gateway_parse(["--port", "9001", "--random-config", "tiny"]).http_port == 9001
