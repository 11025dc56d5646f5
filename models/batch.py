"""A step's attention layout (AttentionBatch), built on the host as Python lists in one array and moved to the
device in one transfer.

`lay_out` writes [input ids N | positions N | slots N | token_request N | context_lens B | query_start B+1 |
block tables B x W] as int64 (W: the step's widest table), the int32 parts cast on the device. With a `Stage` (a
CUDA graph bucket's static buffers, models/cuda_graphs.py) the parts are padded to the bucket, written typed into
the stage's pinned host twin and uploaded by one copy into the graph's own input buffer, no cast on the device:
the padding rows sit at position 0, write the scratch slot and belong to request b - 1 (a padding request of
context 0; with B == b the last real one, of whose keys they read key 0 only); past a request's table its row
holds what an earlier step left (never read). The batch's tensors are then views of that buffer, valid until the
next step of that bucket.
"""
from __future__ import annotations

import math
from array import array
from itertools import accumulate
from dataclasses import dataclass, field

import torch

VERIFY_ROWS = 16                  # query rows a request up to which the reference attention pads requests together


@dataclass
class AttentionBatch:
    """Per-step layout shared by all layers. N new tokens of B requests, flattened request-major.

    The device tensors below are what the kernels read (fixed shapes given N, B and the table width,
    so a CUDA graph can hold them as static buffers); the reference fields (`context_slots`,
    `query_pad_index`, `mask`: reference_groups) are built from the host copy on first use, for the PyTorch
    path only.
    """
    positions: torch.Tensor       # [N] int64 absolute position of each new token
    slot_mapping: torch.Tensor    # [N] int64 flat cache slot the new token is written to
    token_request: torch.Tensor   # [N] int32 request index b of each new token
    context_lens: torch.Tensor    # [B] int32 keys request b attends after this step (start + query len)
    query_start: torch.Tensor     # [B + 1] int32 first row of each request's tokens (qo_indptr)
    block_tables: torch.Tensor    # [B, max_blocks] int32 page ids of each request, 0-padded
    query_lens: list[int]
    request_ids: list[str]
    block_size: int = 16
    host_block_tables: torch.Tensor | None = None   # CPU copy of block_tables (planning, reference)
    host_starts: list[int] | None = None            # context length of each request before this step
    attention_backend: str | None = None            # force 'triton' / 'reference' / ... (graphs: 'triton')
    plans: dict = field(default_factory=dict, repr=False)   # per-step backend state (e.g. a FlashInfer plan)
    input_ids: torch.Tensor | None = None           # [N] int64 the step's tokens, when laid out with them

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    def last_token_index(self) -> torch.Tensor:
        # [B] row of each request's last new token in the flattened [N] layout
        ends = torch.tensor(self.query_lens, device=self.positions.device).cumsum(0)
        return ends - 1

    # --- reference layout (kernels/mla.py): padded [B, Lmax] context, dense mask ----------
    def reference_groups(self) -> list[tuple]:
        """The PyTorch path's padded layout, by groups of requests whose query lengths pad alike -> per group (its
        rows [n] in the flattened [N] layout, or None: all of them in order; context_slots [b, Lmax] flat slots of
        each request's context, 0-padded; query_pad_index [n] into a [b * Tmax] padded query layout; mask
        [b, Tmax, Lmax], True where the query may attend the key). Decode and verify rows (<= VERIFY_ROWS a
        request) are one group, prompt chunks go by powers of two of their length: padding a decode row to a
        prompt chunk's length cost the CPU a step B times the chunk's own attention (an 800-token prompt riding a
        Verify of 6 requests: 52 s, not 1.8)."""
        if "reference" not in self.plans:
            keys = [0 if n <= VERIFY_ROWS else max(n - 1, 1).bit_length() for n in self.query_lens]
            if len(set(keys)) <= 1:
                groups = [(None, list(range(len(keys))))]
            else:
                first = [0, *accumulate(self.query_lens)]
                groups = []
                for key in sorted(set(keys)):
                    reqs = [b for b, k in enumerate(keys) if k == key]
                    rows = torch.cat([torch.arange(first[b], first[b + 1]) for b in reqs])
                    groups.append((rows.to(self.positions.device), reqs))
            self.plans["reference"] = [(rows, *self._padded(reqs)) for rows, reqs in groups]
        return self.plans["reference"]

    def _padded(self, reqs: list[int]):
        starts, lens, bs = [self.host_starts[b] for b in reqs], [self.query_lens[b] for b in reqs], self.block_size
        B, tmax = len(lens), max(lens, default=0)
        ctx = [s + n for s, n in zip(starts, lens)]
        lmax = max(ctx, default=0)
        tables = self.host_block_tables.long()[reqs]
        j = torch.arange(lmax)
        slots = tables.gather(1, (j // bs)[None].expand(B, -1).clamp(max=tables.shape[1] - 1)) * bs + j % bs   # [B, L]
        slots = slots.masked_fill(j[None, :] >= torch.tensor(ctx)[:, None], 0)
        pad = torch.cat([torch.arange(n) + b * tmax for b, n in enumerate(lens)]) if B else torch.zeros(0).long()
        qpos = torch.tensor(starts)[:, None] + torch.arange(tmax)[None, :]         # [B, Tmax]
        mask = j[None, None, :] <= qpos[:, :, None]                                 # causal over context
        dev = self.positions.device
        return slots.to(dev), pad.to(dev), mask.to(dev)


def aligned_parts(parts: list[list[int]], multiple: int = 4) -> tuple[torch.Tensor, list[int]]:
    """Host int lists laid end to end in one int64 tensor, each from a multiple of `multiple` elements (4: 16 bytes
    as int32 or int64), zeros between -> (flat, start of each). Triton compiles a kernel once per alignment of its
    pointers: views at offsets of N elements would make an eager step of another N mod 4 compile a variant mid-run
    (about a second). Built as an array, not by torch.tensor(list) (3-4x slower per element)."""
    flat, starts = array("q"), []
    for p in parts:
        starts.append(len(flat))
        flat.extend(p)
        flat.extend([0] * (-len(flat) % multiple))
    return torch.frombuffer(flat, dtype=torch.long), starts


class TwinBuffer:
    """Typed parts of ONE device byte buffer with a host twin (pinned with CUDA): a step writes the parts on the host
    (numpy views, `writable`) and uploads them by one asynchronous copy (`upload`), no cast on the device: on the
    H200 host a batch-1 layout with three CUDA calls took 0.21 ms, its lists 0.03 ms on a CPU (BENCHMARKS.md,
    twenty-seventh session). Parts start 16-byte aligned (Triton compiles a kernel per pointer alignment)."""

    def __init__(self, kinds: list[tuple[torch.dtype, tuple[int, ...]]], device):
        at = [0]
        for dtype, shape in kinds:
            size = dtype.itemsize * math.prod(shape)
            at.append(at[-1] + -(-size // 16) * 16)
        device = torch.device(device)
        self.dev = torch.zeros(at[-1], dtype=torch.uint8, device=device)
        self.host = torch.zeros(at[-1], dtype=torch.uint8, pin_memory=device.type == "cuda")
        self.at = at                                                   # each part's first byte, then the end
        split = lambda t: [t[a:a + dtype.itemsize * math.prod(shape)].view(dtype).view(shape)
                           for (dtype, shape), a in zip(kinds, at)]
        self.parts = split(self.dev)                                   # the device views a graph reads
        self._host = [h.numpy() for h in split(self.host)]
        self.uploaded = torch.cuda.Event() if device.type == "cuda" else None

    def writable(self) -> list:
        """The host parts (numpy), once the twin's last upload has run (long since, but in back-to-back steps)."""
        if self.uploaded is not None:
            self.uploaded.synchronize()
        return self._host

    def upload(self, end: int | None = None) -> None:
        """The twin's bytes [0, end) (default: all) to the device, on its current stream (as the event's record)."""
        if end is None or end >= self.at[-1]:
            self.dev.copy_(self.host, non_blocking=True)
        else:
            self.dev[:end].copy_(self.host[:end], non_blocking=True)
        if self.uploaded is not None:
            self.uploaded.record(torch.cuda.current_stream(self.dev.device))


def table_rows_end(buf: TwinBuffer, B: int, mb: int, w: int) -> int:
    """The byte after the step's part of a TwinBuffer whose LAST part is int32 block tables [b, mb]: rows 0..B-1, w
    entries each (a long context's table, mb entries a row, is not uploaded whole every step)."""
    return buf.at[-2] + 4 * ((B - 1) * mb + w) if B else buf.at[-2]


MAX_VIEWS = 256          # step shapes whose device views a Stage keeps


@dataclass
class Stage:
    """A CUDA graph bucket's input buffers: n tokens of b requests, tables mb wide, on one device, as one TwinBuffer:
    input ids, positions, slots (int64 [n] each), token_request (int32 [n]), context_lens (int32 [b]), query_start
    (int32 [b + 1]), block tables (int32 [b, mb]). `rows`: the bucket's [n, D] row inputs (the draft's hidden
    rows)."""
    n: int
    b: int
    mb: int
    scratch_slot: int
    buf: TwinBuffer
    rows: list = field(default_factory=list)
    _views: dict = field(default_factory=dict)    # (N, B, w) -> that step's device views (at most MAX_VIEWS kept)

    @staticmethod
    def new(n: int, b: int, mb: int, scratch_slot: int, device, rows: list | None = None) -> "Stage":
        i64, i32 = torch.int64, torch.int32
        buf = TwinBuffer([(i64, (n,)), (i64, (n,)), (i64, (n,)), (i32, (n,)), (i32, (b,)), (i32, (b + 1,)),
                          (i32, (b, mb))], device)
        s = Stage(n, b, mb, scratch_slot, buf, rows or [])
        lay_out([], [], [], [], 1, device, stage=s)                               # all padding
        return s

    def views(self, N: int, B: int, w: int) -> AttentionBatch:
        """The device views of a step of N tokens, B requests, tables w wide (made once per shape)."""
        key = (N, B, w)
        if key not in self._views:
            if len(self._views) >= MAX_VIEWS:
                self._views.clear()
            ids, pos, slots, req, ctx, qs, tab = self.buf.parts
            self._views[key] = (ids[:N], pos[:N], slots[:N], req[:N], ctx[:B], qs[:B + 1], tab[:B, :w])
        ids, pos, slots, req, ctx, qs, tab = self._views[key]
        return AttentionBatch(input_ids=ids, positions=pos, slot_mapping=slots, token_request=req, context_lens=ctx,
                              query_start=qs, block_tables=tab, query_lens=[], request_ids=[])

    def holds(self, batch: AttentionBatch) -> bool:
        return batch.positions.untyped_storage().data_ptr() == self.buf.dev.untyped_storage().data_ptr()

    def batch(self) -> AttentionBatch:
        """The whole padded layout as one batch (what a graph captures)."""
        return self.views(self.n, self.b, self.mb)


def _views(packed, small, tables, at, N, B) -> AttentionBatch:
    i = at[3]
    return AttentionBatch(
        input_ids=packed[at[0]:at[0] + N], positions=packed[at[1]:at[1] + N], slot_mapping=packed[at[2]:at[2] + N],
        token_request=small[:N], context_lens=small[at[4] - i:at[4] - i + B],
        query_start=small[at[5] - i:at[5] - i + B + 1], block_tables=tables, query_lens=[], request_ids=[])


def lay_out(request_ids: list[str], tables: list[list[int]], starts: list[int], query_lens: list[int],
            block_size: int, device, tokens: list[int] | None = None, stage: Stage | None = None) -> AttentionBatch:
    """Requests, their block tables, context lengths before the step and new-token counts -> the step's batch (tokens:
    its input ids, else the ids part holds zeros and batch.input_ids is None). Python lists into one array: a
    decode step's layout is on its critical path (BENCHMARKS.md, twenty-second session, item 6)."""
    bs, B, N = block_size, len(query_lens), sum(query_lens)
    w = max([len(t) for t in tables] + [1])
    pos, slots, req, qstart = [], [], [], [0]
    for r, (t, s, q) in enumerate(zip(tables, starts, query_lens)):
        pos += range(s, s + q)
        for j in range(s // bs, -(-(s + q) // bs)):                               # slots: runs within a block
            slots += range(t[j] * bs + max(s - j * bs, 0), t[j] * bs + min(s + q - j * bs, bs))
        req += [r] * q
        qstart.append(qstart[-1] + q)
    ctx = [s + q for s, q in zip(starts, query_lens)]
    if stage is not None:
        out, host_tables = _into_stage(stage, tokens, pos, slots, req, ctx, qstart, tables, w)
    else:
        host, at = aligned_parts([tokens or [0] * N, pos, slots, req, ctx, qstart,
                                  [x for t in tables for x in t + [0] * (w - len(t))]])
        at.append(len(host))
        host_tables = host[at[6]:at[6] + B * w].view(B, w).to(torch.int32)
        packed = host.to(device, non_blocking=True)       # staged at once from pageable memory: no wait for the
                                                          # stream's queued work (a blocking copy syncs it)
        small = packed[at[3]:].to(torch.int32)
        out = _views(packed, small, small[at[6] - at[3]:at[6] - at[3] + B * w].view(B, w), at, N, B)
    out.input_ids = out.input_ids if tokens is not None else None
    out.query_lens, out.request_ids, out.block_size = list(query_lens), list(request_ids), bs
    out.host_starts, out.host_block_tables = list(starts), host_tables
    return out


def _into_stage(stage: Stage, tokens, pos, slots, req, ctx, qstart, tables, w: int):
    """A step's parts written into the stage's host twin (padding: position 0, the scratch slot, request b - 1,
    context 0, query start N) and uploaded in one copy -> (its device views, its host tables [B, w])."""
    N, B, b = len(pos), len(ctx), stage.b
    ids_h, pos_h, slots_h, req_h, ctx_h, qs_h, tab_h = stage.buf.writable()
    ids_h[:N], ids_h[N:] = tokens if tokens is not None else 0, 0
    pos_h[:N], pos_h[N:] = pos, 0
    slots_h[:N], slots_h[N:] = slots, stage.scratch_slot
    req_h[:N], req_h[N:] = req, b - 1
    ctx_h[:B], ctx_h[B:] = ctx, 0
    qs_h[:B + 1], qs_h[B + 1:] = qstart, N
    for r, t in enumerate(tables):                  # past a request's table: zeros to w, then what an earlier step
        tab_h[r, :len(t)], tab_h[r, len(t):w] = t, 0      # left (never read)
    stage.buf.upload(table_rows_end(stage.buf, B, stage.mb, w))
    return stage.views(N, B, w), torch.from_numpy(tab_h[:B, :w].copy())
