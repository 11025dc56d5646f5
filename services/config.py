"""ServiceConfig: the one typed config of a target or draft process, parsed and validated at start."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, fields

import torch

from infra.help import DefaultsHelp
from infra.defaults import DRAFT_Q_MASS, DRAFT_Q_WIDTH, HIDDEN_TRANSPORTS, MAX_DRAFT_TOKENS, MAX_MODEL_LEN
from infra.ports import check_addr_port, check_port
from models.config import QUANTIZATIONS
from services.rendezvous import resolve
from services.target.synthetic import parse_profile

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_PORTS = {"target": 50052, "draft": 50053}
DEFAULT_DIST_ADDRS = {"target": "127.0.0.1:29660", "draft": "127.0.0.1:29670"}
FLAG_HELP = {
    "max_model_len": "context a request may use, prompt + output (0: the model's max_position_embeddings); "
                     "never more than the model's or the KV cache's (--num-blocks x --block-size)",
    "random_config": "serve a random-weight preset of models/presets.py (v2-lite, v2-lite-yarn, v32-slice, tiny, tiny-v32) built "
                     "on the device, instead of --model; no tokenizer: clients send token ids",
    "seed": "seed of the --random-config weights (target and draft must use the same one)",
    "dist_addr": "rendezvous of the rank group: HOST:PORT of rank 0's TCP store (reachable from every rank's host), "
                 "or env:// (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE from the environment)",
    "local_ranks": "ranks rank 0 starts on this host (0: all of --tp); the others run `tandem ROLE <same flags> "
                   "--rank I` on their hosts",
    "index_scoring": "DeepSeek-V3.2 sparse attention: how the indexer scores keys; exact (fp32 scores, as "
                     "transformers), deployed (Hadamard + fp8 e4m3 keys, as DeepSeek's kernels) or auto "
                     "(deployed on CUDA, exact on CPU). Ignored for models without an indexer",
    "no_prefix_cache": "turn prefix caching off: by default full blocks of committed tokens are named by content "
                       "and shared by later requests with the same prefix (give it to target and draft alike: a "
                       "draft without it re-syncs every request the target found cached)",
    "quantization": "weights of this service's model: fp8 (DeepSeek's e4m3 with a scale per 128x128 block: MLA "
                    "projections, dense MLPs, shared and routed experts; norms, router, attention core and LM head keep "
                    "--dtype; an fp8 checkpoint is kept as stored, a wider one quantized at load), none (every weight in "
                    "--dtype; an fp8 checkpoint is dequantized) or auto (the checkpoint's own format; on a CPU "
                    "dequantized). The draft's flag is its own: its MTP layer may run fp8 or not whatever the target does",
    "draft_q_mass": f"draft: a sampled draft token is drawn from the draft's distribution cut to its most probable "
                    f"tokens of this mass (at most {DRAFT_Q_WIDTH}), and only those travel to the target (a few KB "
                    "a token instead of 4 x vocab bytes); output stays distributed as the target's, acceptance loses "
                    "at most the cut mass. 1: the whole distribution",
    "synthetic_acceptance": "BENCHMARK ONLY, changes the output: the target accepts each draft token with "
                            "probability P (stopping at the first rejection) instead of checking it, after the "
                            "real forward pass; greedy requests only. P, or P1,P2,... per position (conditional "
                            "on the one before; the last repeats), e.g. 0.92,0.72,0.36. Empty: off (default)",
    "no_local_lane": "answer the round call (the target's Verify, the draft's Propose) over gRPC only; by default it "
                     "is also answered on an abstract Unix socket that a gateway in this host and network namespace "
                     "uses instead (GetInfo local_lane; never with TLS)",
    "threads": "torch CPU threads. On a CPU the row count from which a GEMM gives each row its own bits is probed "
               "at this count (kernels/rows.cpu_gemm_rows: 4 on one thread, 16 on two on this project's CPU); "
               "where none holds it warns, and greedy K > 0 may part from K = 0 at a near-tie",
    "request_idle_s": "release what a gone gateway left (it crashed, or its Release was lost: the KV blocks were "
                      "held for good). Target: a request no Prefill or Verify named for this many seconds (a running "
                      "request is named every round). Draft: the requests of a gateway session that made no call "
                      "this long (a live gateway calls at least every quarter of it). 0: never",
    "lane_spin_ms": "the local lane's reader polls without sleeping this long after each call before it blocks, so the "
                    "next round's call finds it awake (one CPU busy meanwhile). -1: 50 on CUDA, 0 on CPU (its cores "
                    "compute)",
    "early_propose": "target: where a gateway's Verify allows it (ProposeAhead.early) and the rows go on a ring, send "
                     "the next round's Propose with the Verify's rows, its acceptance following them, before this host "
                     "reads it "
                     "(services/draft/early.py); auto: on CUDA only (on a CPU the acceptance is computed by then)",
}


@dataclass(frozen=True)
class ServiceConfig:
    role: str                        # target | draft
    model: str
    device: str = "cpu"
    dtype: str = "float32"
    host: str = "127.0.0.1"
    port: int = 0
    bridge_addr: str = "127.0.0.1:29650"
    hidden_transport: str = "auto"   # auto | gloo | nccl | ipc | inline (auto: agreed with the peer, services/bridge)
    num_blocks: int = 2048
    block_size: int = 16
    max_model_len: int = MAX_MODEL_LEN   # 0: the model's own (launch.context_limit caps it by model and cache)
    threads: int = 1                 # torch CPU threads when serving, on any device (a local cluster stays calm)
    request_idle_s: float = 600.0    # target: a request unnamed this long is released; draft: a silent session's (0: never)
    bridge_timeout_s: float = 10.0   # draft: how long Propose waits for a bridge frame
    bridge_ipc_mib: int = 256        # target: CUDA IPC ring of 8 slots (a slot: the largest transfer; larger go inline)
    tp: int = 1                      # tensor-parallel ranks (processes)
    ep: int = 1                      # expert-parallel groups among them (divides tp)
    sequence_parallel: bool = False  # SP-MoE: rows reduce-scattered around each MoE layer
    dist_addr: str = ""              # rendezvous of the rank group (default: per role)
    rank: int = 0                    # set by rank 0 when it starts the others (or by hand on another host)
    local_ranks: int = 0             # ranks rank 0 starts on its host (0: all of --tp); services/rendezvous.py
    otlp_endpoint: str = ""          # OTLP/gRPC trace export (default: OTEL_EXPORTER_OTLP_ENDPOINT; none: off)
    tls_cert: str = ""               # TLS (infra/tls.py): this server's certificate chain and key
    tls_key: str = ""
    tls_ca: str = ""                 # with a CA: clients must present a certificate it signed (mutual TLS)
    max_message_bytes: int = 256 << 20   # largest gRPC message received or sent (inline rows included)
    max_draft_tokens: int = MAX_DRAFT_TOKENS   # per request: Propose's num_draft_tokens / Verify's draft_token_ids
    max_logprobs: int = 20           # target: top-n alternatives a Prefill / Verify item may ask for
    random_config: str = ""          # a models/presets.py preset with random weights instead of --model
    seed: int = 0                    # --random-config: the weights' seed (target and draft must agree)
    synthetic_acceptance: str = ""   # BENCHMARK ONLY (target): P or P1,P2,.. per position (services/target/synthetic.py)
    enforce_eager: bool = False      # cuda: no CUDA graphs (they are used where tp = 1, models/cuda_graphs.py)
    cuda_graph_max_batch: int = 64   # cuda: graphs for batches up to this are captured at start (larger: lazily)
    index_scoring: str = "auto"      # V3.2 indexer: auto | exact | deployed (models/kv_cache.index_scoring_for)
    no_prefix_cache: bool = False    # prefix caching off (on: full blocks shared by content, models/prefix_cache.py)
    quantization: str = "auto"       # auto | none | fp8 (models/config.QUANTIZATIONS; the draft's is its own)
    draft_q_mass: float = DRAFT_Q_MASS   # draft: sampled drafts from q's top tokens of this mass (kernels/noise.py)
    no_local_lane: bool = False      # the round call on gRPC only (default: also on a local socket, services/lane.py)
    lane_spin_ms: float = -1.0       # the local lane's reader polls this long after a call before it sleeps (-1: auto)
    early_propose: str = "auto"      # target: auto | on | off, a Verify's push before its acceptance (draft/early.py)

    @property
    def rank_device(self) -> str:
        """cuda:I on rank 0 -> cuda:I+rank on the others of its host (LOCAL_RANK when a launcher set it)."""
        if not self.device.startswith("cuda"):
            return self.device
        base = int(self.device.split(":")[1]) if ":" in self.device else 0
        return f"cuda:{base + int(os.environ.get('LOCAL_RANK', self.rank))}"

    @property
    def lane_spin_s(self) -> float:
        ms = self.lane_spin_ms if self.lane_spin_ms >= 0 else (50.0 if self.device.startswith("cuda") else 0.0)
        return ms / 1000

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def bridge_backend(self) -> str | None:
        """None: inline rows only. Otherwise what this side asks its bridge for (auto | gloo | nccl | ipc);
        auto is settled with the peer's device (NCCL between GPUs, CUDA IPC on one GPU, gloo on CPU)."""
        return None if self.hidden_transport == "inline" else self.hidden_transport

    def validate(self) -> "ServiceConfig":
        def need(ok, msg):
            if not ok:
                raise SystemExit(f"tandem {self.role}: {msg}")
        need(self.dtype in DTYPES, f"--dtype must be one of {list(DTYPES)}, got {self.dtype!r}")
        need(self.hidden_transport in HIDDEN_TRANSPORTS,
             f"--hidden-transport must be {'|'.join(HIDDEN_TRANSPORTS)}, got {self.hidden_transport!r}")
        need(not self.device.startswith("cuda") or torch.cuda.is_available(), "--device cuda but CUDA is not available")
        need(self.bridge_backend not in ("nccl", "ipc") or self.device.startswith("cuda"),
             f"--hidden-transport {self.hidden_transport} needs --device cuda")
        need(self.bridge_backend != "shm" or not self.device.startswith("cuda"),
             "--hidden-transport shm needs --device cpu (on one GPU: ipc)")
        need(self.index_scoring in ("auto", "exact", "deployed"),
             f"--index-scoring must be auto|exact|deployed, got {self.index_scoring!r}")
        need(self.quantization in QUANTIZATIONS,
             f"--quantization must be one of {'|'.join(QUANTIZATIONS)}, got {self.quantization!r}")
        need(self.bridge_ipc_mib > 0, f"--bridge-ipc-mib must be > 0, got {self.bridge_ipc_mib}")
        need(self.num_blocks > 0 and self.block_size > 0, "--num-blocks and --block-size must be > 0")
        need(":" in self.bridge_addr, f"--bridge-addr must be host:port, got {self.bridge_addr!r}")
        need(self.tp >= 1 and self.ep >= 1 and self.tp % self.ep == 0, f"--ep ({self.ep}) must divide --tp ({self.tp})")
        need(0 <= self.rank < self.tp, f"--rank must be in [0, {self.tp}), got {self.rank}")
        need(0 <= self.local_ranks <= self.tp, f"--local-ranks must be in [0, --tp {self.tp}], got {self.local_ranks}")
        need(self.tp == 1 or ":" in self.dist_addr, f"--dist-addr must be host:port or env://, got {self.dist_addr!r}")
        need(self.max_message_bytes >= 1 << 16, f"--max-message-bytes must be >= 65536, got {self.max_message_bytes}")
        need(0 < self.draft_q_mass <= 1, f"--draft-q-mass must be in (0, 1], got {self.draft_q_mass}")
        need(self.request_idle_s >= 0, f"--request-idle-s must be >= 0 (0: never), got {self.request_idle_s}")
        need(self.lane_spin_ms >= 0 or self.lane_spin_ms == -1, f"--lane-spin-ms must be >= 0 or -1 (auto), got "
                                                                  f"{self.lane_spin_ms}")
        need(self.early_propose in ("auto", "on", "off"), f"--early-propose must be auto, on or off, got "
                                                            f"{self.early_propose!r}")
        need(self.max_draft_tokens >= 0 and self.max_logprobs >= 0, "--max-draft-tokens and --max-logprobs must be >= 0")
        need(self.max_model_len >= 0, f"--max-model-len must be >= 0 (0: the model's own), got {self.max_model_len}")
        need(self.device == "cpu" or self.device.split(":")[0] == "cuda", f"--device must be cpu, cuda or cuda:N, "
             f"got {self.device!r}")
        check_port("--grpc-port", self.port, f"tandem {self.role}", least=0)
        check_addr_port("--bridge-addr", self.bridge_addr, f"tandem {self.role}")
        if self.dist_addr:
            check_addr_port("--dist-addr", self.dist_addr, f"tandem {self.role}")
        try:
            parse_profile(self.synthetic_acceptance)
        except ValueError as e:
            need(False, f"{e}")
        self.tls.validate(f"tandem {self.role}")
        return self

    @property
    def tls(self):
        from infra.tls import TlsFiles
        return TlsFiles(self.tls_cert, self.tls_key, self.tls_ca)


def parse(role: str, argv, description: str) -> ServiceConfig:
    from models.tiny import default_model
    p = argparse.ArgumentParser(prog=f"tandem {role}", description=description,
                                formatter_class=DefaultsHelp)
    flags = {"port": ["--grpc-port"], "tp": ["--tp", "--tensor-parallel-size", "--tp-size"]}   # vLLM's, SGLang's names
    for f in fields(ServiceConfig):
        if f.name == "role":
            continue
        default = DEFAULT_PORTS[role] if f.name == "port" else (None if f.name == "model" else f.default)
        names = flags.get(f.name, ["--" + f.name.replace("_", "-")])
        if isinstance(f.default, bool):
            p.add_argument(*names, dest=f.name, action="store_true", help=FLAG_HELP.get(f.name))
        else:
            p.add_argument(*names, dest=f.name, default=default, type=type(f.default) if f.name != "model" else str,
                           help=FLAG_HELP.get(f.name) or f.name.replace("_", " "))
    a = p.parse_args(argv)
    a.dist_addr = a.dist_addr or DEFAULT_DIST_ADDRS[role]
    try:
        a.dist_addr, a.tp, a.rank, a.local_ranks = resolve(a.dist_addr, a.tp, a.rank, a.local_ranks)
    except ValueError as e:
        raise SystemExit(f"tandem {role}: {e}") from None
    if a.random_config:
        from models.presets import PresetError, random_model_id
        if a.model:
            raise SystemExit(f"tandem {role}: --model ({a.model}) and --random-config ({a.random_config}) "
                             "exclude each other")
        try:
            a.model = random_model_id(a.random_config, a.seed)
        except PresetError as e:
            raise SystemExit(f"tandem {role}: {e}") from None
    return ServiceConfig(role=role, **{**vars(a), "model": str(a.model or default_model())}).validate()


def setup_torch(cfg: ServiceConfig) -> None:
    if cfg.device == "cpu":
        torch.set_num_threads(cfg.threads)
    else:
        torch.cuda.set_device(torch.device(cfg.rank_device))
