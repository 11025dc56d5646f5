"""The command line as a new user meets it: every help shows its defaults, `tandem bench --help` lists the
benchmarks and exits 0, and the flag names vLLM and SGLang users type work as aliases."""
import subprocess
import sys

import pytest
import torch

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
                                                ("target", "--num-blocks", "2048"), ("draft", "--max-model-len", "0")])
def test_help_shows_defaults(cmd, flag, default):
    r = tandem(cmd, "--help")
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert flag in text and f"(default: {default})" in text, r.stdout


@pytest.mark.parametrize("cmd", ["serve", "gateway", "target", "draft"])
def test_help_shows_no_default_that_says_nothing(cmd):
    """A switch's default ("--no-busy-poll ... (default: True)") or one its help already states in words is left out."""
    text = " ".join(tandem(cmd, "--help").stdout.split())
    assert "(default: True)" not in text and "(default: False)" not in text, text
    assert not [part for part in text.split(" --") if part.count("(default") > 1], "a default said twice"


def test_bench_given_the_http_port_for_gateway_says_which_port(tmp_path):
    """The bench's --gateway is the gRPC address; an HTTP listener there is named, not a gRPC traceback."""
    import http.server
    import threading
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        r = tandem("bench", "acceptance", "--gateway", f"127.0.0.1:{srv.server_port}", "--out", str(tmp_path))
    finally:
        srv.shutdown()
    assert r.returncode == 1 and "--gateway" in r.stderr and "gRPC address" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr, r.stderr[-2000:]


def test_vllm_and_sglang_flag_names():
    from services.config import parse
    from tandem import serve
    a = serve.parse(["--tensor-parallel-size", "2", "--port", "9000", "--random-config", "tiny"])
    assert (a.tp, a.http_port) == (2, 9000)
    assert serve.parse(["--tp-size", "2", "--random-config", "tiny"]).tp == 2
    assert parse("target", ["--tensor-parallel-size", "2", "--random-config", "tiny"], "").tp == 2
    from gateway.config import parse as gateway_parse
    assert gateway_parse(["--port", "9001", "--random-config", "tiny"]).http_port == 9001


def test_a_bad_acceptance_profile_is_refused_at_once():
    """`tandem serve` names a bad --synthetic-acceptance before it starts anything (the target would refuse it
    too, and the supervisor would restart it five times)."""
    r = tandem("serve", "--random-config", "tiny", "--synthetic-acceptance", "0.9,1.5")
    assert r.returncode == 2 and "every probability must be in [0, 1], got 0.9,1.5" in r.stderr, r.stderr
    for name in ("overlap", "profile"):
        assert f"\n  {name} " in tandem("bench", "--help").stdout


def test_context_limit_is_the_models_capped_by_the_cache():
    from services.launch import context_limit
    assert context_limit(0, 163840, 2048 * 16) == 32768           # a YaRN model: the whole cache, not more
    assert context_limit(0, 2048, 32768) == 2048                   # the model's own positions
    assert context_limit(40000, 163840, 65536) == 40000            # asked, within both
    assert context_limit(9000, 4096, 65536) == 4096                # never beyond the model's positions
    from tandem import serve
    cmds = dict((role, argv) for role, argv, _ in serve.commands(serve.parse(["--max-model-len", "1000"])))
    for role in ("target", "draft"):
        i = cmds[role].index("--max-model-len")
        assert cmds[role][i + 1] == "1000", (role, cmds[role])


def test_a_foreign_kernels_package_is_named(tmp_path):
    """Hugging Face's `kernels` distribution has this repo's kernels/ import name: `tandem` exits naming the clash
    instead of failing later on a missing kernels.dispatch."""
    (tmp_path / "kernels").mkdir()
    (tmp_path / "kernels" / "__init__.py").write_text("")
    r = subprocess.run([sys.executable, "-c", "import sys; from tandem.cli import main; sys.exit(main(['bench']))"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": f"{tmp_path}:{REPO}", "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "not Tandem's kernels/ package" in r.stderr, r.stderr
    assert str(tmp_path / "kernels" / "__init__.py") in r.stderr, r.stderr


@pytest.mark.parametrize("args, message", [
    (["--grpc-port", "-5"], "--grpc-port must be a TCP port in 1..65535, got -5"),
    (["--bridge-port", "70000"], "--bridge-port must be a TCP port in 1..65535, got 70000"),
    (["--dist-port", "65530"], "--dist-port (+10, the draft's) must be a TCP port in 1..65535, got 65540"),
    (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),          # (was: the gateway spun at 100 % on a request)
    (["--max-waiting", "-1"], "--max-waiting must be >= 0, got -1"),    # (was: every request refused)
    (["--max-restarts", "-1"], "--max-restarts must be >= 0, got -1"),
    (["--max-model-len", "-1"], "--max-model-len must be >= 0, got -1"),
    (["--device", "tpu"], "--device must be cpu, cuda or cuda:N, got 'tpu'"),
    (["--model", "/nonexistent"], "no tokenizer.json there"),
])
def test_serve_refuses_what_no_service_runs_with_before_starting_any(args, message):
    """Flags no service could run with are named before anything starts (found probing as an operator: some were
    tracebacks after the model loaded, some were accepted and hung or refused every request, negative ports wrapped)."""
    r = tandem("serve", *(["--random-config", "tiny"] if "--model" not in args else []), *args)
    assert r.returncode != 0 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_generate_refuses_bad_values_by_name(tmp_path):
    for args, message in ((["--max-tokens", "-1"], "--max-tokens must be in 1.."), (["--prompt", ""], "--prompt is empty"),
                          (["--model", str(tmp_path)], "not a checkpoint"), (["--device", "tpu"], "invalid choice"),
                          (["--threads", "0"], "--threads must be >= 1"),
                          *([(["--device", "cuda"], "sees no CUDA device")] if not torch.cuda.is_available() else [])):
        r = tandem("generate", *args)
        assert r.returncode != 0 and message in r.stderr and "Traceback" not in r.stderr, (args, r.stderr)
