"""`tandem serve`: the local cluster — target, draft and gateway as separate processes.

Starts each, waits until all report SERVING over gRPC health, prints the endpoints, restarts a
process that exits, or a target or draft that hangs (bounded retries with backoff: tandem/supervise.py),
and stops all of them cleanly on Ctrl-C / SIGTERM (or when one exhausted its restarts).
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from infra.defaults import (DRAFT_Q_MASS, HIDDEN_TRANSPORTS, MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS,
                            NUM_SPECULATIVE_TOKENS, transport_misfit)
from infra.help import DefaultsHelp
from models.config import QUANTIZATIONS
from models.presets import PRESETS
from tandem.supervise import Supervisor


def wait_serving(addr: str, proc: subprocess.Popen, name: str, timeout_s: float, tls=None) -> None:
    from infra import tls as tls_mod
    stub = health_pb2_grpc.HealthStub(tls_mod.channel(addr, tls or tls_mod.PLAINTEXT))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{name} exited with code {proc.returncode} while starting")
        try:
            if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                return
        except grpc.RpcError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{name} at {addr} was not SERVING after {timeout_s:.0f}s")


def add_gateway_flags(p) -> None:
    """The gateway's limits and how it calls the services."""
    p.add_argument("--max-waiting", type=int, default=256, help="gateway: requests queued before new ones get "
                   "429 / RESOURCE_EXHAUSTED (0: unbounded)")
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="gateway: longest prompt (0: the model's limit)")
    p.add_argument("--max-output-tokens", type=int, default=0, help="gateway: largest max_tokens (0: the model's limit)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="gateway: largest REST body / gRPC message")
    p.add_argument("--no-overlap-rounds", dest="overlap_rounds", action="store_false", help="gateway: commit each "
                   "round before sending the next round's Propose (default: overlapped, gateway/proposals.py)")
    p.add_argument("--no-propose-ahead", dest="propose_ahead", action="store_false", help="gateway: send each "
                   "round's Propose itself (default: the target sends it to the draft from the Verify before, where "
                   "the services' local lanes reach each other: gateway/proposals.py)")
    p.add_argument("--no-join-ahead", dest="join_ahead", action="store_false", help="gateway: joining requests' "
                   "first Propose in a pass of its own (default: in the pass of the push it rides: "
                   "gateway/proposals.py)")
    p.add_argument("--no-early-propose", dest="early_propose", action="store_false", help="gateway: the target "
                   "sends the next round's Propose once its host read the acceptance (default: as the acceptance is "
                   "queued on the GPU: services/draft/early.py)")
    p.add_argument("--no-mixed-prefill", dest="mixed_prefill", action="store_false", help="gateway: prefill new "
                   "prompts in a call of their own (default: in the round's Verify forward: gateway/chunking.py)")
    p.add_argument("--late-admission", action="store_true", help="gateway: requests that arrive while a round "
                   "waits for its drafts ride that round's Verify (default: the next step's; gateway/chunking.py)")
    p.add_argument("--service-calls", default="local", choices=("local", "stream", "unary"), help="gateway: each "
                   "round's Verify and Propose on the services' local lanes (Unix sockets; else as stream), on one "
                   "persistent gRPC stream per service, or as unary calls")
    p.add_argument("--no-busy-poll", dest="busy_poll", action="store_false", help="gateway: sleep while a round's "
                   "Verify or Propose is out (default: keep polling, one CPU busy while calls run)")
    p.add_argument("--draft-timeout", type=float, default=10.0, help="gateway: seconds a Propose may take before "
                   "the round goes on without drafts (a hung draft holds every stream this long once)")
    p.add_argument("--rpc-timeout", type=float, default=60.0, help="gateway: seconds a Prefill or Verify may take")
    p.add_argument("--default-max-tokens", type=int, default=256, help="gateway: max_tokens of a gRPC or chat "
                   "request that sets none")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="at Ctrl-C / SIGTERM the gateway refuses new "
                   "requests and lets those running finish for at most this many seconds before the services stop")


def parse(argv):
    from models.tiny import default_model
    p = argparse.ArgumentParser(prog="tandem serve", description=__doc__,
                                formatter_class=DefaultsHelp)
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled model)")
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=NUM_SPECULATIVE_TOKENS,
                   help="draft tokens per round (0: plain decoding); with --speculation adaptive the cap")
    p.add_argument("--speculation", default="adaptive", choices=["adaptive", "fixed"], help="gateway: each "
                   "request's k chosen each round from live acceptance and measured costs, or a fixed K a round")
    p.add_argument("--device", default="cpu", help="cpu | cuda (target on cuda:0, draft on cuda:1 if present)")
    p.add_argument("--draft-device", default="", help="the draft's device (cuda:0: the target's GPU, rows by CUDA "
                   "IPC); default: cuda:1 with --device cuda and two GPUs, else the target's")
    p.add_argument("--dtype", default=None, help="default: float32 on cpu, bfloat16 on cuda")
    p.add_argument("--hidden-transport", default="auto", choices=HIDDEN_TRANSPORTS, help="auto: NCCL between two "
                   "GPUs, CUDA IPC on one GPU, shared memory on one host's CPU, else gloo")
    p.add_argument("--host", default="127.0.0.1", help="the gateway's listeners (the services bind loopback)")
    p.add_argument("--grpc-port", type=int, default=50051, help="the gateway's public gRPC port")
    p.add_argument("--http-port", "--port", type=int, default=8000, help="the gateway's REST API (OpenAI-compatible; "
                   "--port as vLLM and SGLang name it)")
    p.add_argument("--served-model-name", default="", help="the REST API's model name (default: the checkpoint's)")
    p.add_argument("--api-key", default="", help="require it as a Bearer token on /v1/* (default: $TANDEM_API_KEY)")
    p.add_argument("--otlp-endpoint", default="", help="OTLP/gRPC trace export from all three services "
                   "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; none: no tracing)")
    for flag, port, what in (("--target-port", 50052, "the target service"), ("--draft-port", 50053, "the draft "
                             "service"), ("--bridge-port", 29650, "the hidden-row bridge's rendezvous")):
        p.add_argument(flag, type=int, default=port, help=what)
    p.add_argument("--num-blocks", type=int, default=2048, help="KV cache blocks of 16 tokens, target and draft")
    p.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN, help="prompt + output a request may use (0: "
                   "the model's max_position_embeddings); never more than the model's or the KV cache's")
    p.add_argument("--tp", "--tensor-parallel-size", "--tp-size", type=int, default=1,
                   help="target tensor-parallel ranks (vLLM's and SGLang's names work too)")
    p.add_argument("--ep", type=int, default=1, help="target expert-parallel groups (divides --tp)")
    p.add_argument("--sequence-parallel", action="store_true", help="SP-MoE in target and draft")
    p.add_argument("--draft-tp", type=int, default=1, help="draft tensor-parallel ranks")
    p.add_argument("--dist-port", type=int, default=29660, help="rank-group rendezvous (target; draft: +10)")
    p.add_argument("--max-batch", type=int, default=64, help="requests in one round")
    p.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS, help="gateway: prompt "
                   "positions one step prefills before the round; longer prompts go in chunks (0: whole)")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds each process may take to serve")
    p.add_argument("--max-restarts", type=int, default=5, help="restarts of a process that exits, within "
                   "10 minutes, before the cluster stops (0: stop when any exits)")
    add_gateway_flags(p)
    p.add_argument("--random-config", default="", help="serve a random-weight preset (models/presets.py: "
                   f"{', '.join(PRESETS)}) built on the device instead of --model; no tokenizer: send token ids")
    p.add_argument("--seed", type=int, default=0, help="seed of the --random-config weights")
    p.add_argument("--enforce-eager", action="store_true", help="cuda: no CUDA graphs in target and draft")
    p.add_argument("--no-prefix-cache", action="store_true", help="prefix caching off in target and draft")
    p.add_argument("--index-scoring", default="auto", choices=["auto", "exact", "deployed"],
                   help="DeepSeek-V3.2 sparse attention in target and draft: exact (fp32 scores, as transformers), "
                   "deployed (Hadamard + fp8 keys, as DeepSeek's kernels), auto: deployed on cuda, exact on cpu")
    p.add_argument("--quantization", default="auto", choices=QUANTIZATIONS, help="target weights: fp8 (DeepSeek's "
                   "e4m3, a scale per 128x128 block; a bf16 checkpoint or preset is quantized at load), none (--dtype; "
                   "an fp8 checkpoint is dequantized), auto (the checkpoint's own format; on a CPU dequantized)")
    p.add_argument("--draft-quantization", default="", choices=("",) + QUANTIZATIONS, help="the MTP draft's "
                   "weights, its own switch (default: --quantization): fp8 MTP layers are measured, not assumed, to "
                   "keep acceptance (tandem bench fp8 --accuracy)")
    p.add_argument("--draft-q-mass", type=float, default=DRAFT_Q_MASS, help="sampled drafts are drawn from the "
                   "draft's distribution cut to its most probable tokens of this mass, and only those travel to the "
                   "target (output keeps the target's distribution; acceptance loses at most the cut mass); 1: all")
    p.add_argument("--bridge-ipc-mib", type=int, default=256, help="target: the CUDA IPC ring of the hidden-row "
                   "bridge (8 slots; a larger transfer goes inline)")
    p.add_argument("--lane-spin-ms", type=float, default=-1.0, help="target and draft: how long the reader of "
                   "their local lane polls without sleeping after a call (-1: 50 on CUDA, 0 on CPU)")
    p.add_argument("--synthetic-acceptance", default="", help="BENCHMARK ONLY, changes the output: "
                   "the target accepts each draft with probability P, or P1,P2,... per position given the one "
                   "before (greedy requests only; empty: off). See services/target/synthetic.py")
    from infra import tls as tls_mod
    tls_mod.add_flags(p)              # the same files for all three services (mutual TLS between them with a CA)
    a = p.parse_args(argv)
    a.tls = tls_mod.TlsFiles(a.tls_cert, a.tls_key, a.tls_ca).validate("tandem serve")
    if a.random_config and a.model:
        p.error(f"--model ({a.model}) and --random-config ({a.random_config}) exclude each other")
    a.model = "" if a.random_config else str(a.model or default_model())
    a.dtype = a.dtype or ("bfloat16" if a.device.startswith("cuda") else "float32")
    from services.target.synthetic import parse_profile
    try:
        parse_profile(a.synthetic_acceptance)          # refused here, not by a target restarted five times
    except ValueError as e:
        p.error(str(e))
    return check(a)


def check(a):
    """What no service could run with, refused by name before any starts (a service refuses it only after
    loading its model, and the supervisor would start it again) -> a."""
    from gateway.config import parse as gateway_config
    from infra.ports import check_port
    for flag, port in (("--http-port", a.http_port), ("--grpc-port", a.grpc_port), ("--target-port", a.target_port),
                       ("--draft-port", a.draft_port), ("--bridge-port", a.bridge_port),
                       ("--dist-port", a.dist_port), ("--dist-port (+10, the draft's)", a.dist_port + 10)):
        check_port(flag, port, "tandem serve")
    for flag, n in (("--max-restarts", a.max_restarts), ("--max-model-len", a.max_model_len)):
        if n < 0:
            raise SystemExit(f"tandem serve: {flag} must be >= 0, got {n}")
    for flag, dev in (("--device", a.device), ("--draft-device", a.draft_device or "cpu")):
        if dev != "cpu" and dev.split(":")[0] != "cuda":
            raise SystemExit(f"tandem serve: {flag} must be cpu, cuda or cuda:N, got {dev!r}")
    gateway = next(cmd for name, cmd, _ in commands(a) if name == "gateway")
    gateway_config(gateway[gateway.index("gateway") + 1:])     # its flags, validated as the gateway will
    return a


def placement(a) -> tuple[str, str]:
    """(target device, draft device). --device cuda: the target on cuda:0, the draft on --draft-device,
    else cuda:1 when two GPUs are visible, else cuda:0 (one GPU shared: rows move by CUDA IPC)."""
    def norm(dev: str) -> str:
        return "cuda:0" if dev == "cuda" else dev
    t_dev = norm(a.device)
    if a.draft_device:
        d_dev = norm(a.draft_device)
    elif a.device == "cuda":
        import torch
        d_dev = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    else:
        d_dev = t_dev
    cuda = t_dev.startswith("cuda") and d_dev.startswith("cuda")
    cpu = not t_dev.startswith("cuda") and not d_dev.startswith("cuda")
    misfit = transport_misfit(a.hidden_transport, cuda, same_gpu=t_dev == d_dev, cpu=cpu)
    if misfit:
        raise SystemExit(f"tandem serve: {misfit}; got target {t_dev}, draft {d_dev}")
    return t_dev, d_dev


def commands(a) -> list[tuple[str, list[str], str]]:
    py = [sys.executable, "-m", "tandem"]
    t_dev, d_dev = placement(a)
    transport = a.hidden_transport    # auto: target and draft settle it from both devices (services/bridge)
    model = ["--random-config", a.random_config, "--seed", str(a.seed)] if a.random_config else ["--model", a.model]
    common = model + ["--dtype", a.dtype, "--hidden-transport", transport, "--index-scoring", a.index_scoring,
                      "--bridge-addr", f"127.0.0.1:{a.bridge_port}", "--num-blocks", str(a.num_blocks),
                      "--max-model-len", str(a.max_model_len)]
    if a.otlp_endpoint:
        common += ["--otlp-endpoint", a.otlp_endpoint]
    tls = [x for flag, path in (("--tls-cert", a.tls_cert), ("--tls-key", a.tls_key), ("--tls-ca", a.tls_ca))
           if path for x in (flag, path)]
    common += tls + (["--enforce-eager"] if a.enforce_eager else [])
    common += ["--no-prefix-cache"] if a.no_prefix_cache else []
    common += ["--lane-spin-ms", str(a.lane_spin_ms)] if a.lane_spin_ms >= 0 else []
    sp = ["--sequence-parallel"] if a.sequence_parallel else []
    cmds = [("target", py + ["target", "--device", t_dev, "--grpc-port", str(a.target_port), "--tp", str(a.tp),
                             "--ep", str(a.ep), "--dist-addr", f"127.0.0.1:{a.dist_port}"] + sp + common
             + ["--bridge-ipc-mib", str(a.bridge_ipc_mib), "--quantization", a.quantization]
             + (["--synthetic-acceptance", a.synthetic_acceptance] if a.synthetic_acceptance else []),
             f"127.0.0.1:{a.target_port}")]
    if a.num_speculative_tokens > 0:
        cmds.append(("draft", py + ["draft", "--device", d_dev, "--grpc-port", str(a.draft_port),
                                    "--tp", str(a.draft_tp), "--dist-addr", f"127.0.0.1:{a.dist_port + 10}"]
                     + sp + common + ["--quantization", a.draft_quantization or a.quantization,
                                      "--draft-q-mass", str(a.draft_q_mass)],
                     f"127.0.0.1:{a.draft_port}"))
    cmds.append(("gateway", py + ["gateway", *(["--random-config", a.random_config] if a.random_config
                                                else ["--model", a.model]), "-k", str(a.num_speculative_tokens),
                                  "--speculation", a.speculation,
                                  "--host", a.host, "--grpc-port", str(a.grpc_port),
                                  "--target-addr", f"127.0.0.1:{a.target_port}",
                                  "--draft-addr", f"127.0.0.1:{a.draft_port}",
                                  "--hidden-transport", "auto" if transport == "ipc" else transport,
                                  "--max-batch", str(a.max_batch),
                                  "--max-num-batched-tokens", str(a.max_num_batched_tokens),
                                  "--http-port", str(a.http_port), "--served-model-name", a.served_model_name,
                                  "--api-key", a.api_key, "--otlp-endpoint", a.otlp_endpoint,
                                  "--max-prompt-tokens", str(a.max_prompt_tokens),
                                  "--max-output-tokens", str(a.max_output_tokens),
                                  "--max-request-bytes", str(a.max_request_bytes),
                                  "--max-waiting", str(a.max_waiting), "--service-calls", a.service_calls,
                                  "--draft-timeout", str(a.draft_timeout), "--rpc-timeout", str(a.rpc_timeout),
                                  "--default-max-tokens", str(a.default_max_tokens),
                                  "--drain-timeout", str(a.drain_timeout)]
                                 + ([] if a.busy_poll else ["--no-busy-poll"])
                                 + ([] if a.overlap_rounds else ["--no-overlap-rounds"])
                                 + ([] if a.propose_ahead else ["--no-propose-ahead"])
                                 + ([] if a.join_ahead else ["--no-join-ahead"])
                                 + ([] if a.early_propose else ["--no-early-propose"])
                                 + ([] if a.mixed_prefill else ["--no-mixed-prefill"])
                                 + (["--late-admission"] if a.late_admission else []) + tls,
                 f"{a.host}:{a.grpc_port}"))
    return cmds


def main(argv=None) -> int:
    a = parse(argv)
    sup = Supervisor([(name, cmd) for name, cmd, _ in commands(a)], {**os.environ, "PYTHONUNBUFFERED": "1"},
                     a.max_restarts)
    stopping = False

    def stop(*_):
        nonlocal stopping
        if stopping and (gw := sup.procs.get("gateway")) is not None and gw.poll() is None:
            gw.terminate()                    # a second Ctrl-C: the gateway stops draining now
        stopping = True

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    try:
        for name, _, addr in commands(a):
            wait_serving(addr, sup.start(name), name, a.startup_timeout, a.tls)
            if name != "gateway":             # a service that hangs is killed and restarted (tandem/supervise.py)
                sup.probe(name, addr, a.tls)
        if a.synthetic_acceptance:
            print(f"tandem: WARNING: BENCHMARK ONLY --synthetic-acceptance {a.synthetic_acceptance}: drafts are "
                  "accepted at random, the output is not the model's", flush=True)
        what = f"random:{a.random_config} (seed {a.seed})" if a.random_config else a.model
        print(f"tandem: serving {what} (K={a.num_speculative_tokens} {a.speculation}, {a.device})", flush=True)
        for name, _, addr in commands(a):
            print(f"  {name:8s} grpc://{addr}", flush=True)
        print(f"  {'REST':8s} {'https' if a.tls.cert else 'http'}://{a.host}:{a.http_port}/v1 (OpenAI-compatible; "
              f"/health, /metrics){'; TLS' if a.tls.cert else ''}", flush=True)
        while not stopping and sup.check(lambda: stopping):    # restarts what exits (tandem/supervise.py)
            time.sleep(0.2)
    finally:
        sup.stop(first_grace_s=a.drain_timeout + 10)
    return 0 if stopping else 1          # given up on a process past --max-restarts: a failure to its supervisor
