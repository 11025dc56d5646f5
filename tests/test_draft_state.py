"""DraftState's transitions (gateway/draft_state.py): what the gateway gives the draft next, and when
a request decodes without drafts."""
from gateway.draft_state import DraftState
from tandem.v1 import rows_pb2


def rows(n: int) -> rows_pb2.HiddenRows:
    return rows_pb2.HiddenRows(request_ids=["a"], rows_per_request=[n], num_rows=n)


def test_speculating_request_gives_the_draft_each_commit_once():
    d = DraftState()
    d.prefilled([1, 2, 3, 7], rows(3), speculate=True, wants_drafts=True)
    assert (d.speculate, d.stale, d.pending, d.position) == (True, False, [1, 2, 3, 7], 0)
    d.proposed()
    assert (d.pending, d.position, d.rows) == ([], 4, None)
    d.verified([7, 7], rows(2))
    assert (d.pending, d.position, d.rows.num_rows) == ([7, 7], 4, 2)
    d.proposed()
    assert d.position == 6


def test_lost_draft_makes_it_stale_until_resynced_or_dropped():
    d = DraftState()
    d.prefilled([1, 7], rows(1), speculate=True, wants_drafts=True)
    d.proposed()
    d.lost()
    assert (d.speculate, d.stale) == (False, True)
    d.verified([7], rows(1))                       # a stale request's commits are not queued for the draft
    assert d.pending == []
    d.resynced([1, 7, 7], rows(2))
    assert (d.speculate, d.stale, d.pending, d.position) == (True, False, [1, 7, 7], 0)
    d.lost()
    d.dropped()
    assert (d.speculate, d.stale) == (False, False)
    d.lost()                                       # nothing to lose: it stays without drafts
    assert (d.speculate, d.stale) == (False, False)


def test_prefill_without_rows_starts_stale_only_when_it_wants_drafts():
    d = DraftState()
    d.prefilled([1, 7], rows(0), speculate=False, wants_drafts=True)
    assert (d.speculate, d.stale) == (False, True)
    d.prefilled([1, 7], rows(0), speculate=False, wants_drafts=False)
    assert (d.speculate, d.stale) == (False, False)


def test_prompt_only_request_gives_the_draft_its_prompt_and_nothing_after():
    """k = 0 while the draft speculates for others: the prompt goes to the draft (its prefix cache), never drafts;
    a Verify before the feed does not replace the pending prompt; once given (or lost), nothing more goes."""
    d = DraftState()
    d.prefilled([1, 2, 3, 7], rows(3), speculate=True, wants_drafts=False)
    assert (d.speculate, d.stale, d.prompt_only, d.pending) == (False, False, True, [1, 2, 3, 7])
    d.verified([7, 8], rows(1))                    # the round verified before the feed went out
    assert (d.pending, d.rows.num_rows) == ([1, 2, 3, 7], 3)
    d.proposed()                                   # a chunk fed: the next chunk is queued by verified
    d.verified([4, 5], rows(2))
    assert (d.pending, d.position, d.prompt_only) == ([4, 5], 4, True)
    d.proposed()
    d.prompt_given()
    d.verified([9], rows(1))
    assert (d.speculate, d.stale, d.prompt_only, d.pending) == (False, False, False, [])
    e = DraftState()
    e.prefilled([1, 7], rows(1), speculate=True, wants_drafts=False)
    e.lost()
    assert (e.speculate, e.stale, e.prompt_only) == (False, False, False)
    f = DraftState()
    f.prefilled([1, 7], rows(1), speculate=False, wants_drafts=False)      # no rows (no draft, or degraded)
    assert (f.speculate, f.stale, f.prompt_only) == (False, False, False)
