"""Row movement around the model, as small pure functions (PyTorch reference of kernels/triton_rows.py).

MTP input preparation: the MTP layer at position i takes (embed(token[i+1]), h[i]) and predicts
token[i+2]. A target step (prefill or verify) ran B requests as one flat sequence: request b's tokens
are tokens[starts[b] : starts[b] + len_b] and its final-norm rows hidden[starts[b] : ...] (same
layout). The draft needs, per request, the first num_rows[b] rows (prefill: the prompt's T rows;
verify: the a + 1 accepted positions t, d1 .. da) each paired with the token after its position: the
next token in the run, and for the last row the token the target just sampled (next_tokens[b]: the
first token after a prompt, the bonus / recovered token after a round).

SP pad / shard / trim: with sequence-parallel MoE, N rows are padded to a multiple of tp, each rank
keeps its S = N_pad / tp rows (reduce-scatter), and after the MoE the all-gathered [tp * S, D] is
trimmed back to the true N rows. Re-stated here from models/parallel.py (kernels/ imports no models/).
"""
from __future__ import annotations

import torch


def mtp_offsets(num_rows: torch.Tensor) -> torch.Tensor:
    """num_rows [B] -> out_starts [B]: where request b's rows begin in the packed output (exclusive cumsum)."""
    n = num_rows.long()
    return n.cumsum(0) - n


def prepare_mtp_inputs(tokens: torch.Tensor, hidden: torch.Tensor, starts: torch.Tensor,
                       num_rows: torch.Tensor, next_tokens: torch.Tensor):
    """tokens [N] (the tokens the target ran), hidden [N, D] (its rows), starts [B], num_rows [B],
    next_tokens [B] -> input_ids [R], rows [R, D], R = sum(num_rows), requests packed in order:

        rows[o_b + i]      = hidden[starts[b] + i]                         i in [0, num_rows[b])
        input_ids[o_b + i] = tokens[starts[b] + i + 1]   if i + 1 < num_rows[b]
                             next_tokens[b]              if i + 1 == num_rows[b]
    with o_b = mtp_offsets(num_rows)[b]. Invariant: starts[b] + num_rows[b] <= N (the kept rows lie
    inside the run; the token after the last kept row need not exist in it).
    """
    B = num_rows.shape[0]
    n = num_rows.long()
    b = torch.repeat_interleave(torch.arange(B, device=n.device), n)           # [R] owning request
    i = torch.arange(b.shape[0], device=n.device) - mtp_offsets(n)[b]            # [R] row within request
    src = starts.long()[b] + i                                                   # [R] row in the run
    after = tokens[(src + 1).clamp(max=tokens.shape[0] - 1)]                    # clamped: last rows use next
    input_ids = torch.where(i + 1 < n[b], after, next_tokens.to(tokens.dtype)[b]).to(tokens.dtype)
    return input_ids, hidden[src]


def pad_rows(x: torch.Tensor, multiple: int) -> torch.Tensor:
    # x: [N, D] -> [ceil(N / multiple) * multiple, D], zero rows appended (the reduce-scatter input)
    extra = -x.shape[0] % multiple
    return torch.cat([x, x.new_zeros(extra, *x.shape[1:])]) if extra else x


def shard_rows(x_pad: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    # x_pad: [tp * S, D] identical on all ranks -> rank's [S, D] (rows rank * S .. rank * S + S - 1)
    return x_pad.chunk(tp, 0)[rank] if tp > 1 else x_pad


def pad_shard_rows(x: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    # x: [N, D] -> rank's [ceil(N / tp), D] of pad_rows(x, tp): what SP keeps before its reduce-scatter
    return shard_rows(pad_rows(x, tp), tp, rank)


def trim_rows(gathered: torch.Tensor, n: int) -> torch.Tensor:
    # gathered: [tp * S, D] all-gathered shards in rank order -> the true [n, D] (n <= tp * S)
    assert n <= gathered.shape[0], f"trim to {n} rows of {gathered.shape[0]}"
    return gathered[:n]
