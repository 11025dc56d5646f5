"""The hidden-row contract: describe rows on the sending side, check them on the receiving side.

A sender asserts its tensor matches the descriptor before it sends. A receiver checks the
descriptor against its own bookkeeping (which requests, how many rows each) before it takes or
indexes a row; every mismatch is a ContractError naming the request, the expected and the actual
count, which the services turn into INVALID_ARGUMENT / FAILED_PRECONDITION.
"""
from __future__ import annotations


import numpy as np
import torch

from infra.errors import ServiceError
from tandem.v1 import rows_pb2 as pb

CONTRACT_VERSION = "tandem.v1/hidden-rows-1"
DTYPE_TO_PB = {torch.float32: pb.DTYPE_FLOAT32, torch.bfloat16: pb.DTYPE_BFLOAT16, torch.float16: pb.DTYPE_FLOAT16,
               torch.int64: pb.DTYPE_INT64}              # int64: a Verify's acceptance frame (draft/early.py)
PB_TO_DTYPE = {v: k for k, v in DTYPE_TO_PB.items()}


class ContractError(ServiceError):
    """A row descriptor disagrees with the receiver's bookkeeping."""


def describe(rows: torch.Tensor, request_ids: list[str], rows_per_request: list[int], transport: int,
             transfer_id: int = 0, used: list[int] | None = None) -> pb.HiddenRows:
    """Descriptor for FULL rows [N, D], request-major; `used`: of each request's rows the first this many are read
    (HiddenRows.used_rows_per_request). Asserts the tensor matches it."""
    n = sum(rows_per_request)
    if rows.dim() != 2 or rows.shape[0] != n or len(request_ids) != len(rows_per_request) or (used is not None and (
            len(used) != len(request_ids) or any(u > r for u, r in zip(used, rows_per_request)))):
        raise RuntimeError(f"sender bug: hidden rows tensor {tuple(rows.shape)} does not match "
                           f"rows_per_request {rows_per_request} (sum {n}) for {len(request_ids)} requests, "
                           f"used {used}")
    msg = pb.HiddenRows(num_rows=n, request_ids=request_ids, rows_per_request=rows_per_request,
                        hidden_size=rows.shape[1], dtype=DTYPE_TO_PB[rows.dtype], layout=pb.ROW_LAYOUT_FULL,
                        transport=transport, transfer_id=transfer_id, used_rows_per_request=used or [])
    if transport == pb.TRANSPORT_INLINE:
        msg.inline_data = rows.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()
    return msg


def check(desc: pb.HiddenRows, expected: dict[str, int], hidden_size: int, dtype: torch.dtype) -> None:
    """Receiver side, before any row is touched. `expected`: request id -> rows this side needs."""
    def fail(msg, code="INVALID_ARGUMENT"):
        raise ContractError(code, f"hidden rows contract: {msg}")
    if len(desc.request_ids) != len(desc.rows_per_request):
        fail(f"request_ids has {len(desc.request_ids)} entries, rows_per_request {len(desc.rows_per_request)}")
    if len(set(desc.request_ids)) != len(desc.request_ids):
        fail("request_ids names a request twice")
    total = sum(desc.rows_per_request)
    if desc.layout == pb.ROW_LAYOUT_FULL:
        if desc.num_rows != total:
            fail(f"num_rows is {desc.num_rows}, rows_per_request sums to {total}")
    elif desc.layout == pb.ROW_LAYOUT_SEQUENCE_SHARDED:
        if desc.shard_count < 1 or desc.shard_index >= desc.shard_count:
            fail(f"shard_index {desc.shard_index} of shard_count {desc.shard_count}")
        padded = -(-total // desc.shard_count) * desc.shard_count
        if desc.padded_num_rows != padded or desc.num_rows != padded // desc.shard_count:
            fail(f"sequence-sharded rows: expected {padded // desc.shard_count} rows of padded total "
                 f"{padded} per shard (sum {total} over {desc.shard_count} shards), got num_rows "
                 f"{desc.num_rows} of padded total {desc.padded_num_rows}")
    else:
        fail(f"layout {desc.layout} is not FULL or SEQUENCE_SHARDED")
    if desc.hidden_size != hidden_size:
        fail(f"hidden_size is {desc.hidden_size}, expected {hidden_size}")
    if PB_TO_DTYPE.get(desc.dtype) != dtype:
        fail(f"dtype is {_dtype_name(desc.dtype)}, expected {_dtype_name(DTYPE_TO_PB[dtype])}")
    field, used = "rows_per_request", desc.rows_per_request
    if desc.used_rows_per_request:                # a Verify's rows: the committed tokens' first, then the rejected
        field, used = "used_rows_per_request", desc.used_rows_per_request
        if desc.layout != pb.ROW_LAYOUT_FULL or len(used) != len(desc.request_ids):
            fail(f"used_rows_per_request has {len(used)} entries for {len(desc.request_ids)} requests (FULL "
                 "layout only)")
        for rid, u, n in zip(desc.request_ids, used, desc.rows_per_request):
            if u > n:
                fail(f"request {rid!r}: used_rows_per_request is {u}, more than its rows_per_request {n}")
    got = dict(zip(desc.request_ids, used))
    for rid, n in expected.items():
        if got.get(rid, n) != n:
            fail(f"request {rid!r}: {field} is {got[rid]}, expected {n} (one row per newly committed token)")
    if desc.transport == pb.TRANSPORT_INLINE:
        row_bytes = hidden_size * torch.finfo(dtype).bits // 8
        if len(desc.inline_data) != desc.num_rows * row_bytes:
            fail(f"inline payload holds {len(desc.inline_data) / row_bytes:g} rows, num_rows is {desc.num_rows}")
    elif desc.transport != pb.TRANSPORT_BRIDGE:
        fail(f"transport {desc.transport} is not INLINE or BRIDGE")


def _dtype_name(v: int) -> str:
    return pb.DType.Name(v) if v in pb.DType.values() else f"{v} (not a DType)"


def finite_flag(rows: torch.Tensor) -> torch.Tensor | None:
    """check_finite's reduction enqueued on the current CUDA stream: -> a pinned host bool, valid once the stream
    is synchronized (the IPC ring's take syncs anyway: the check then adds no sync); None off CUDA."""
    if not rows.is_cuda or not rows.numel():
        return None
    flag = torch.empty((), dtype=torch.bool, pin_memory=True)
    flag.copy_(torch.isfinite(rows.sum(dtype=torch.float32)), non_blocking=True)
    return flag


def check_finite(rows: torch.Tensor, field: str, flag: torch.Tensor | None = None) -> None:
    """Rows that arrived must be finite: a NaN or inf row would reach the MTP layer and every draft. One
    reduction and one read on the host when they are (a NaN or inf makes the fp32 sum non-finite; finite rows
    whose sum overflows go on to the row check, which finds nothing); `flag`: that reduction's result, read
    already (finite_flag)."""
    if not rows.numel() or bool(flag if flag is not None else torch.isfinite(rows.sum(dtype=torch.float32))):
        return
    bad = ~torch.isfinite(rows).all(dim=-1)
    if bool(bad.any()):
        raise ContractError("INVALID_ARGUMENT", f"hidden rows contract: {field} holds non-finite values "
                            f"(NaN or inf) in {int(bad.sum())} of {rows.shape[0]} rows, first at row "
                            f"{int(bad.nonzero()[0, 0])}")


def check_payload(desc: pb.HiddenRows, rows: torch.Tensor) -> None:
    """The rows that arrived (bridge frame) must be exactly what the descriptor declares."""
    if tuple(rows.shape) != (desc.num_rows, desc.hidden_size):
        raise ContractError("INVALID_ARGUMENT", f"hidden rows contract: transfer {desc.transfer_id} carried "
                            f"{rows.shape[0]} rows of {rows.shape[-1]}, descriptor says num_rows "
                            f"{desc.num_rows} of {desc.hidden_size}")


def expect_rows(rows: torch.Tensor, expected: int, what: str) -> torch.Tensor:
    """A producer of hidden rows (a model forward) must return one row per input token before any
    row is indexed: a sequence-parallel shard that was not re-gathered has ceil(T_pad / tp)."""
    if rows.shape[0] != expected:
        raise ContractError("INVALID_ARGUMENT", f"hidden rows contract: {what} returned {rows.shape[0]} rows "
                            f"for {expected} input tokens (expected {expected})")
    return rows


def decode_inline(desc: pb.HiddenRows, device="cpu") -> torch.Tensor:
    dtype = PB_TO_DTYPE[desc.dtype]
    raw = torch.from_numpy(np.frombuffer(desc.inline_data, dtype=np.uint8).copy())
    return raw.view(dtype).view(desc.num_rows, desc.hidden_size).to(device)


def rows_by_request(desc: pb.HiddenRows, rows: torch.Tensor) -> dict[str, torch.Tensor]:
    """FULL rows [N, D] -> request id -> the rows it uses [n_r, D] (views, request-major order)."""
    parts = rows.split(list(desc.rows_per_request))
    if desc.used_rows_per_request:
        parts = [p[:u] for p, u in zip(parts, desc.used_rows_per_request)]
    return dict(zip(desc.request_ids, parts))
