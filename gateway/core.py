"""What the gRPC and REST front ends share: the tokenizer, the model's limits, request validation and
the life of one generation (submit -> events -> release), independent of the wire format."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import grpc
from tokenizers import Tokenizer

from gateway.scheduler import Event, GenRequest, Scheduler
from gateway.text import TextStream
from tandem.v1 import rows_pb2

UINT64 = 1 << 64
FLOAT32_MAX = 3.4028234663852886e38     # sampling floats travel as float32: larger would arrive as inf
MAX_STOP = 16                           # stop strings per request


class RequestError(ValueError):
    """A bad request: `param` names the field; the message says what was expected and what came."""

    def __init__(self, param: str | None, message: str, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


class GenerationError(RuntimeError):
    """A request that failed after it was accepted (a service error), or was refused at admission
    (the target is down, the queue is full), with the gRPC status."""

    http_status: int | None = None         # where the gRPC code's usual HTTP status does not fit

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class NoTokenizer:
    """The tokenizer of a model that has none (`--random-config`, random weights): token ids in and out.
    Text prompts are a 400 / INVALID_ARGUMENT naming the field; output text is empty."""

    def __init__(self, model_name: str):
        self.model_name = model_name

    def encode(self, text: str, add_special_tokens: bool = True):
        raise RequestError("prompt", f"prompt: model {self.model_name!r} has random weights and no tokenizer; "
                                     "send token ids (GenerateRequest.token_ids, or a REST prompt of integers), "
                                     f"got text of {len(text)} characters")

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return ""

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return 0

    def id_to_token(self, tid: int) -> None:
        return None


class QueueFull(GenerationError):
    """Back-pressure: HTTP 429 (retry later), not the 503 other RESOURCE_EXHAUSTED answers map to."""
    http_status = 429


@dataclass
class Limits:
    vocab_size: int
    max_model_len: int
    num_speculative_tokens: int
    default_max_tokens: int
    max_logprobs: int = 20
    max_prompt_tokens: int = 0          # --max-prompt-tokens (0: the model's limit)
    max_output_tokens: int = 0          # --max-output-tokens: the largest max_tokens (0: the model's limit)
    max_request_bytes: int = 4 << 20    # --max-request-bytes: REST body / gRPC message


class Gateway:
    def __init__(self, model_dir: str, model_name: str, tokenizer: Tokenizer, scheduler: Scheduler, limits: Limits):
        self.model_dir, self.model_name, self.tokenizer = model_dir, model_name, tokenizer
        self.scheduler, self.limits = scheduler, limits
        path = Path(model_dir) / "tokenizer_config.json"
        self.tokenizer_config: dict = json.loads(path.read_text()) if path.exists() else {}
        self._token_bytes: int | None = None

    # --- tokens ----------------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt", limit: bool = True) -> list[int]:
        """Token ids of `text`; a 400 / INVALID_ARGUMENT naming `param` when it is not valid Unicode (a JSON
        string may carry a lone UTF-16 surrogate, "\\ud800", which no tokenizer takes), or (`limit`, a prompt) when it
        is more bytes than the model's limit of tokens can cover, found without tokenizing it (seconds of a core for
        megabytes). Call it off the event loop (asyncio.to_thread: the tokenizer releases the GIL)."""
        try:
            n = len(text.encode("utf-8"))
        except UnicodeEncodeError as e:
            raise RequestError(param, f"{param}: holds an unpaired UTF-16 surrogate (U+{ord(text[e.start]):04X}) at "
                                      f"character {e.start}: not valid Unicode") from None
        if limit and n > self.prompt_limit and n > self.prompt_limit * self.token_bytes():
            raise RequestError(param, f"{param}: {n} bytes of text are more than {self.prompt_limit - 1} tokens, "
                                      f"the model's limit of prompt tokens, can hold ({self.token_bytes()} bytes the "
                                      "longest token)")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def token_bytes(self) -> int:
        """The most UTF-8 bytes one token stands for (a text of n bytes is at least n / this many tokens)."""
        if self._token_bytes is None:
            size = self.tokenizer.get_vocab_size(with_added_tokens=True)
            self._token_bytes = max((len(self.tokenizer.decode([i], skip_special_tokens=False).encode())
                                     for i in range(size)), default=1 << 30)     # (no tokenizer: never)
        return self._token_bytes

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def token_str(self, tid: int) -> str:
        return self.tokenizer.decode([tid], skip_special_tokens=False)

    def check_ids(self, ids: list[int], param: str) -> None:
        if not ids:
            raise RequestError(param, f"{param}: empty (give text or token ids)")
        bad = [t for t in ids if not 0 <= t < self.limits.vocab_size]
        if bad:
            raise RequestError(param, f"{param}: id {bad[0]} is out of range, vocab_size is {self.limits.vocab_size}")

    @property
    def prompt_limit(self) -> int:
        """Prompt + max_tokens must fit this: the target's max_model_len, all of it (near its end a request
        drafts fewer tokens a round, GenRequest.round_k)."""
        return self.limits.max_model_len

    # --- requests ----------------------------------------------------------------------------------
    def new_request(self, ids: list[int], max_tokens: int | None, *, temperature: float = 0.0, top_p: float = 0.0,
                    top_k: int = 0, seed: int | None = None, stop: list[str] = (), ignore_eos: bool = False,
                    k: int | None = None, logprobs: int | None = None, prompt_logprobs: bool = False,
                    ids_param: str = "prompt", span=None, default_max_tokens: int | None = None,
                    tokens_param: str = "max_tokens") -> GenRequest:
        """Validate and build one generation; raises RequestError naming the field (`tokens_param`: the name
        max_tokens came as). max_tokens None: the default (`default_max_tokens`, else the gateway's), within the
        configured cap and the room the prompt leaves (an explicit max_tokens that does not fit is refused)."""
        lim = self.limits
        self.check_ids(ids, ids_param)
        if len(ids) >= self.prompt_limit:     # the target holds the prompt and at least its first token
            raise RequestError(ids_param, f"{ids_param}: the prompt has {len(ids)} tokens, more than the model's limit of "
                                          f"{self.prompt_limit - 1} prompt tokens (max_model_len {lim.max_model_len} "
                                          "holds the prompt and its first generated token)")
        if max_tokens is None:
            default = default_max_tokens or lim.default_max_tokens
            max_tokens = min(default, lim.max_output_tokens or default, self.prompt_limit - len(ids))
        if max_tokens < 0:
            raise RequestError(tokens_param, f"{tokens_param}: must be >= 0, got {max_tokens}")
        self.check_limits(len(ids), max_tokens, ids_param, tokens_param)
        if len(ids) + max_tokens > self.prompt_limit:
            raise RequestError(tokens_param, f"prompt ({len(ids)} tokens) + {tokens_param} ({max_tokens}) exceeds "
                                             f"the model's limit of {self.prompt_limit} tokens")
        if not temperature >= 0:
            raise RequestError("temperature", f"temperature: must be >= 0, got {temperature}")
        if not temperature <= FLOAT32_MAX:
            raise RequestError("temperature", f"temperature: must be a finite number, got {temperature}")
        if len(stop) > MAX_STOP:
            raise RequestError("stop", f"stop: at most {MAX_STOP} strings, got {len(stop)}")
        if not 0 <= top_p <= 1:
            raise RequestError("top_p", f"top_p: must be in [0, 1], got {top_p}")
        if top_k < 0:
            raise RequestError("top_k", f"top_k: must be >= 0 (or -1: off), got {top_k}")
        top_k = 0 if top_k >= lim.vocab_size else top_k      # the whole vocabulary: off (fits uint32)
        if seed is not None and not 0 <= seed < UINT64:
            raise RequestError("seed", f"seed: must be in [0, 2**64), got {seed}")
        if logprobs is not None and not 0 <= logprobs <= lim.max_logprobs:
            raise RequestError("logprobs", f"logprobs: must be in [0, {lim.max_logprobs}], got {logprobs}")
        if k is None:
            k = lim.num_speculative_tokens
        elif k < 0:
            raise RequestError("num_speculative_tokens", f"num_speculative_tokens: must be >= 0, got {k}")
        elif k > lim.num_speculative_tokens:
            raise RequestError("num_speculative_tokens", f"num_speculative_tokens: at most "
                               f"{lim.num_speculative_tokens} on this gateway, got {k}")
        sampling = rows_pb2.SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k)
        if seed is not None:
            sampling.seed = seed
        return GenRequest(id=self.scheduler.new_id(), prompt_ids=list(ids), max_tokens=max_tokens, sampling=sampling,
                          text=TextStream(self.tokenizer, list(stop)), ignore_eos=ignore_eos,
                          k=k if max_tokens > 0 else 0, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                          span=span, max_model_len=lim.max_model_len)

    def check_limits(self, n_prompt: int, max_tokens: int, ids_param: str, tokens_param: str = "max_tokens") -> None:
        """The configured per-request caps (--max-prompt-tokens, --max-output-tokens), named in the error."""
        lim = self.limits
        if lim.max_prompt_tokens and n_prompt > lim.max_prompt_tokens:
            raise RequestError(ids_param, f"{ids_param}: the prompt has {n_prompt} tokens, more than this gateway's limit of "
                                          f"{lim.max_prompt_tokens} (--max-prompt-tokens)")
        if lim.max_output_tokens and max_tokens > lim.max_output_tokens:
            raise RequestError(tokens_param, f"{tokens_param}: {max_tokens} is more than this gateway's limit of "
                                             f"{lim.max_output_tokens} (--max-output-tokens)")

    def admit(self, n: int) -> None:
        """Before building n new requests: GenerationError when the target is down (UNAVAILABLE) or the
        queue is full (RESOURCE_EXHAUSTED, HTTP 429)."""
        most = self.scheduler.avail.max_waiting
        if most and n > most:                 # never admitted, however long the client waits: not a 429
            raise RequestError("prompt", f"prompt: {n} generations (prompts x n) in one request, more than this "
                                         f"gateway queues at once ({most}, --max-waiting)")
        refused = self.scheduler.avail.admit(n, len(self.scheduler.waiting))
        if refused is not None:
            raise (QueueFull if refused[0] == grpc.StatusCode.RESOURCE_EXHAUSTED else GenerationError)(*refused)

    async def events(self, r: GenRequest):
        """Submit r and yield its events until it finishes; raises GenerationError on a service
        error. Leaving early (client gone) cancels r and frees its state in both services."""
        self.scheduler.submit(r)
        try:
            while True:
                ev: Event = await r.events.get()
                if ev.error:
                    raise GenerationError(*ev.error)
                yield ev
                if ev.finish_reason:
                    return
        finally:
            self.scheduler.cancel(r)
