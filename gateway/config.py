"""The gateway's typed configuration and its command line (`tandem gateway --help`): every flag is a
field of GatewayConfig, checked once at start so that a bad value fails by name before any service
is contacted."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from infra import tls as tls_mod
from infra.help import DefaultsHelp
from infra.defaults import HIDDEN_TRANSPORTS, MAX_DRAFT_TOKENS, MAX_NUM_BATCHED_TOKENS, NUM_SPECULATIVE_TOKENS
from infra.ports import check_addr_port, check_port
from tandem.v1 import rows_pb2

DESCRIPTION = """`tandem gateway`: the public face in front of the target and draft services — the gRPC
GenerateService and the OpenAI-compatible REST API (gateway/http.py), in one process and event loop."""
# how the gateway asks the target for rows: auto (the services settle it), bridge, or inline
SPECULATION = ("fixed", "adaptive")       # gateway/adaptive.py
SERVICE_CALLS = ("local", "stream", "unary")   # gateway/local_lane.py, gateway/lanes.py, plain gRPC calls
TRANSPORTS = {name: rows_pb2.TRANSPORT_INLINE if name == "inline" else rows_pb2.TRANSPORT_UNSPECIFIED if name == "auto"
              else rows_pb2.TRANSPORT_BRIDGE for name in HIDDEN_TRANSPORTS}


@dataclass(frozen=True)
class GatewayConfig:
    model: str
    target_addr: str = "127.0.0.1:50052"
    draft_addr: str = "127.0.0.1:50053"
    num_speculative_tokens: int = NUM_SPECULATIVE_TOKENS    # K; with --speculation adaptive, the cap
    speculation: str = "adaptive"            # how many drafts each request gets a round: SPECULATION
    adaptive_reprobe_rounds: int = 0         # adaptive: rounds between wakes of parked requests (0: auto)
    host: str = "127.0.0.1"
    grpc_port: int = 50051
    max_batch: int = 64
    max_num_batched_tokens: int = MAX_NUM_BATCHED_TOKENS   # prompt positions one step prefills (chunks); 0: whole
    default_max_tokens: int = 256
    hidden_transport: str = "auto"
    connect_timeout_s: float = 120.0         # the target must serve within it, else the gateway exits 1
    draft_wait_s: float = 120.0              # ... the draft: past it the gateway serves without drafts until it does
    drain_timeout_s: float = 30.0            # at shutdown, requests held run this long before they fail (drain.py)
    http_port: int = 8000
    served_model_name: str = ""
    api_key: str = ""
    otlp_endpoint: str = ""
    stats_interval_s: float = 10.0
    max_logprobs: int = 20
    max_prompt_tokens: int = 0               # per request; 0: the model's limit
    max_output_tokens: int = 0               # the largest max_tokens; 0: the model's limit
    max_request_bytes: int = 4 << 20         # REST body and gRPC message of the public API
    tls_cert: str = ""                       # TLS on both listeners and to the services (tandem/tls.py)
    tls_key: str = ""
    tls_ca: str = ""
    max_waiting: int = 256                   # requests queued for a Prefill; beyond: 429 / RESOURCE_EXHAUSTED
    rpc_timeout_s: float = 60.0              # a Prefill / Verify / RecomputeRows call (client deadlines bound it)
    draft_timeout_s: float = 10.0            # a Propose; past it the round goes on without drafts
    random_config: str = ""                  # target and draft run a random-weight preset: no tokenizer
    service_calls: str = "local"             # a round's Verify / Propose: local lane (else stream), stream, or unary
    overlap_rounds: bool = True              # the next round's Propose goes out before this round commits
    propose_ahead: bool = True               # ... from the target, named in the Verify (gateway/proposals.py)
    join_ahead: bool = True                  # joining requests' first Propose computed in that push's pass
    early_propose: bool = True               # that push sent as the Verify's acceptance is queued (draft/early.py)
    mixed_prefill: bool = True               # a step's Prefill rides its round's Verify: one forward (gateway/chunking.py)
    late_admission: bool = False             # requests arriving while a round waits for its drafts ride its Verify
    busy_poll: bool = True                   # the loop polls, never sleeps, while a Verify / Propose is out

    @property
    def model_name(self) -> str:
        return self.served_model_name or (f"random-{self.random_config}" if self.random_config
                                          else Path(self.model).name)

    @property
    def tls(self) -> tls_mod.TlsFiles:
        return tls_mod.TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)

    @property
    def key(self) -> str:
        """The API key guarding REST /v1/* and gRPC GenerateService ('': open)."""
        return self.api_key or os.environ.get("TANDEM_API_KEY", "")

    def validate(self) -> "GatewayConfig":
        if not 0 <= self.num_speculative_tokens <= MAX_DRAFT_TOKENS:
            raise SystemExit(f"--num-speculative-tokens must be in [0, {MAX_DRAFT_TOKENS}], got "
                             f"{self.num_speculative_tokens}")
        if self.speculation not in SPECULATION:
            raise SystemExit(f"--speculation must be one of {list(SPECULATION)}, got {self.speculation!r}")
        if self.adaptive_reprobe_rounds < 0:
            raise SystemExit(f"--adaptive-reprobe-rounds must be >= 0 (0: automatic), got {self.adaptive_reprobe_rounds}")
        if self.max_num_batched_tokens < 0:
            raise SystemExit(f"--max-num-batched-tokens must be >= 0 (0: prompts prefilled whole), got "
                             f"{self.max_num_batched_tokens}")
        if self.hidden_transport not in TRANSPORTS:
            raise SystemExit(f"--hidden-transport must be one of {list(TRANSPORTS)}, got {self.hidden_transport!r}")
        if self.service_calls not in SERVICE_CALLS:
            raise SystemExit(f"--service-calls must be one of {'|'.join(SERVICE_CALLS)}, got {self.service_calls!r}")
        if not self.random_config and not (Path(self.model) / "tokenizer.json").exists():
            raise SystemExit(f"--model {self.model}: no tokenizer.json there")
        if min(self.max_prompt_tokens, self.max_output_tokens) < 0 or self.max_request_bytes < 1024:
            raise SystemExit("--max-prompt-tokens and --max-output-tokens must be >= 0, --max-request-bytes >= 1024")
        if self.drain_timeout_s < 0:
            raise SystemExit(f"tandem gateway: --drain-timeout must be >= 0, got {self.drain_timeout_s}")
        if not (self.connect_timeout_s > 0 and self.draft_wait_s >= 0):
            raise SystemExit(f"tandem gateway: --connect-timeout must be > 0 and --draft-wait >= 0, got "
                             f"{self.connect_timeout_s} and {self.draft_wait_s}")
        if not (self.draft_timeout_s > 0 and self.rpc_timeout_s > 0):
            raise SystemExit(f"tandem gateway: --draft-timeout and --rpc-timeout must be > 0, got "
                             f"{self.draft_timeout_s} and {self.rpc_timeout_s}")
        for flag, n, least in (("--max-batch", self.max_batch, 1), ("--max-waiting", self.max_waiting, 0),
                               ("--default-max-tokens", self.default_max_tokens, 1), ("--max-logprobs",
                               self.max_logprobs, 0)):
            if n < least:
                raise SystemExit(f"tandem gateway: {flag} must be >= {least}, got {n}")
        for flag, port in (("--grpc-port", self.grpc_port), ("--http-port", self.http_port)):
            check_port(flag, port, "tandem gateway", least=0)
        for flag, addr in (("--target-addr", self.target_addr), ("--draft-addr", self.draft_addr)):
            check_addr_port(flag, addr, "tandem gateway")
        self.tls.validate("tandem gateway")
        return self


def add_service_flags(p: argparse.ArgumentParser) -> None:
    """Where the target and draft are, and how long the gateway waits for them at start."""
    p.add_argument("--target-addr", default="127.0.0.1:50052", help="the target service")
    p.add_argument("--draft-addr", default="127.0.0.1:50053", help="the draft service")
    p.add_argument("--connect-timeout", dest="connect_timeout_s", type=float, default=120.0, help="seconds to wait "
                   "at start for the target to serve before exiting with status 1")
    p.add_argument("--draft-wait", dest="draft_wait_s", type=float, default=120.0, help="seconds to wait at start "
                   "for the draft to serve (at the same time as the target); past them the gateway serves without "
                   "drafts (plain decoding, /health: speculation degraded) and speculates once the draft answers")
    p.add_argument("--drain-timeout", dest="drain_timeout_s", type=float, default=30.0, help="at SIGTERM (or SIGINT) "
                   "refuse new requests and let those running finish for at most this many seconds; then, or at a "
                   "second signal, they fail with UNAVAILABLE (an error event on REST streams)")


def parse(argv) -> GatewayConfig:
    from infra.paths import default_model_dir
    p = argparse.ArgumentParser(prog="tandem gateway", description=DESCRIPTION,
                                formatter_class=DefaultsHelp)
    p.add_argument("--model", default=None, help="checkpoint dir (for its tokenizer)")
    add_service_flags(p)
    p.add_argument("--num-speculative-tokens", "-k", type=int, default=NUM_SPECULATIVE_TOKENS,
                   help="draft tokens per round (0: plain decoding); with --speculation adaptive the most a "
                   "request drafts; a request may ask for fewer (num_speculative_tokens)")
    p.add_argument("--speculation", default="adaptive", help="adaptive: each round picks each request's k in 0..K "
                   "from its live acceptance and the measured round costs (gateway/adaptive.py); fixed: every request "
                   "drafts its K each round")
    p.add_argument("--adaptive-reprobe-rounds", type=int, default=0, help="adaptive: rounds between two probes of "
                   "requests parked at k = 0 (0: as often as 1%% of the round time pays for)")
    p.add_argument("--no-overlap-rounds", dest="overlap_rounds", action="store_false", help="commit each round "
                   "before the next round's Propose is sent (default: the draft computes the next round's drafts "
                   "while the gateway commits, detokenizes and streams this one's tokens: gateway/proposals.py)")
    p.add_argument("--no-propose-ahead", dest="propose_ahead", action="store_false", help="with overlapped rounds, "
                   "send the next round's Propose from the gateway once the Verify has answered (default: where the "
                   "gateway reaches both services' local lanes, its Verify names the next round's draft work and the "
                   "target sends that Propose to the draft as soon as it has the tokens and rows: gateway/proposals.py)")
    p.add_argument("--no-join-ahead", dest="join_ahead", action="store_false", help="send the first Propose of "
                   "requests that joined as a Verify answered after that Verify's push, a second pass of the draft "
                   "(default: it rides the push and the draft computes both in one: gateway/proposals.py join)")
    p.add_argument("--no-early-propose", dest="early_propose", action="store_false", help="the target's push once "
                   "its host read the acceptance (default: as the acceptance is queued, on a GPU: draft/early.py)")
    p.add_argument("--no-mixed-prefill", dest="mixed_prefill", action="store_false", help="prefill new prompts in "
                   "a call of their own before the round (default: while requests run, the step's Prefill rides the "
                   "round's Verify and the target computes both in one forward: gateway/chunking.py)")
    p.add_argument("--late-admission", action="store_true", help="admit requests that arrive while a round waits "
                   "for its drafts into that round's Verify (their prompts ride its forward, a round sooner; default: "
                   "the next step's Prefill; measured in BENCHMARKS.md: more mixed forwards, each with fewer prompts)")
    p.add_argument("--no-busy-poll", dest="busy_poll", action="store_false", help="sleep while a round's "
                   "Verify or Propose is out (default: the event loop keeps polling until the answer is in, one "
                   "CPU busy while calls run: an idle CPU of a VM wakes 0.2-0.4 ms late, gateway/lanes.py)")
    p.add_argument("--host", default="127.0.0.1", help="address of the gRPC and HTTP listeners")
    p.add_argument("--grpc-port", type=int, default=50051, help="the GenerateService")
    p.add_argument("--http-port", "--port", type=int, default=8000,
                   help="OpenAI-compatible REST API, /health, /metrics (--port: vLLM's and SGLang's name)")
    p.add_argument("--served-model-name", default="", help="the model name of the REST API (default: the "
                   "checkpoint directory's name)")
    p.add_argument("--api-key", default="", help="require `Authorization: Bearer KEY` on /v1/* "
                   "(default: $TANDEM_API_KEY; none: open)")
    p.add_argument("--otlp-endpoint", default="", help="OTLP/gRPC trace export, e.g. http://127.0.0.1:4317 "
                   "(default: $OTEL_EXPORTER_OTLP_ENDPOINT; none: no tracing)")
    p.add_argument("--stats-interval", dest="stats_interval_s", type=float, default=10.0,
                   help="seconds between stats log lines (0: off)")
    p.add_argument("--max-batch", type=int, default=64, help="requests in one round")
    p.add_argument("--max-num-batched-tokens", type=int, default=MAX_NUM_BATCHED_TOKENS, help="prompt positions "
                   "one scheduler step prefills before the round of the running requests: longer prompts go in "
                   "chunks, one per round (0: every prompt whole in one step)")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens of a gRPC request that sets none")
    p.add_argument("--max-logprobs", type=int, default=20, help="top-n logprobs a request may ask for")
    p.add_argument("--hidden-transport", default="auto", help="how the target sends rows to the draft: "
                   + " | ".join(HIDDEN_TRANSPORTS))
    p.add_argument("--max-waiting", type=int, default=256, help="requests queued for a Prefill before new ones "
                   "get HTTP 429 / gRPC RESOURCE_EXHAUSTED (0: unbounded)")
    p.add_argument("--rpc-timeout", dest="rpc_timeout_s", type=float, default=60.0,
                   help="seconds a Prefill or Verify call may take (shorter when every request in it has a deadline)")
    p.add_argument("--draft-timeout", dest="draft_timeout_s", type=float, default=10.0,
                   help="seconds a Propose may take before the round goes on without drafts (speculation degraded)")
    p.add_argument("--max-prompt-tokens", type=int, default=0, help="longest prompt a request may bring, in "
                   "tokens (400 / INVALID_ARGUMENT beyond; 0: the model's limit)")
    p.add_argument("--max-output-tokens", type=int, default=0, help="largest max_tokens a request may ask for "
                   "(0: the model's limit)")
    p.add_argument("--max-request-bytes", type=int, default=4 << 20, help="largest REST body (413 beyond) and "
                   "gRPC request message (RESOURCE_EXHAUSTED beyond) of the public API")
    p.add_argument("--random-config", default="", help="target and draft serve a random-weight preset "
                   "(--random-config of `tandem target`): no tokenizer, requests must send token ids")
    p.add_argument("--service-calls", default="local", help="each round's Verify and Propose: 'local' (the service's "
                   "local lane, a Unix socket, where it offers one and this gateway shares its host and network namespace; "
                   "else as 'stream'; gateway/local_lane.py), 'stream' (one persistent gRPC stream per service, "
                   "gateway/lanes.py) or 'unary' (one gRPC call each)")
    tls_mod.add_flags(p)
    a = p.parse_args(argv)
    if a.model and a.random_config:      # as on target and draft: one model, named one way
        p.error(f"--model ({a.model}) and --random-config ({a.random_config}) exclude each other")
    model = a.model or (f"random:{a.random_config}" if a.random_config else default_model_dir())
    return GatewayConfig(**{**vars(a), "model": str(model)}).validate()
