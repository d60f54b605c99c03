"""The n-gram index lookup drafting proposes from."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from common.spec.lookup_index import LookupIndex


def naive_propose(seq: list[int], k: int, max_ngram: int) -> tuple[list[int], int]:
    """The longest suffix (<= max_ngram) seen earlier, its latest earlier occurrence, continued."""
    for n in range(min(max_ngram, len(seq) - 1), 0, -1):
        suffix = seq[-n:]
        for end in range(len(seq) - 1, n - 1, -1):
            if seq[end - n : end] == suffix:
                out: list[int] = []
                for j in range(k):
                    i = end + j
                    out.append(seq[i] if i < len(seq) else out[i - len(seq)])
                return out, n
    return [], 0


def test_proposes_what_followed_the_longest_earlier_match():
    index = LookupIndex(max_ngram=4)
    # "7 8 9" occurred before and was followed by 4 5; "9" alone was followed by 1 later
    seq = [7, 8, 9, 4, 5, 9, 1, 2, 7, 8, 9]
    assert index.propose(seq, 2) == ([4, 5], 3)
    assert LookupIndex().propose([1, 2, 3], 4) == ([], 0)  # nothing repeats
    assert LookupIndex().propose([5], 4) == ([], 0)


def test_a_loop_is_proposed_as_a_loop():
    # the match runs into the suffix itself: the proposal goes on with its own tokens
    assert LookupIndex(max_ngram=4).propose([1, 2, 3, 1, 2, 3, 1, 2], 7) == ([3, 1, 2, 3, 1, 2, 3], 4)
    assert LookupIndex(max_ngram=2).propose([6, 6, 6], 3) == ([6, 6, 6], 2)


@settings(max_examples=200, deadline=None)
@given(
    seq=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    cuts=st.lists(st.integers(1, 60), max_size=4),
    k=st.integers(1, 6),
    max_ngram=st.integers(1, 5),
)
def test_incremental_index_agrees_with_a_scan_of_the_whole_sequence(seq, cuts, k, max_ngram):
    """The index grows round by round; every proposal equals a brute-force scan of the sequence so far."""
    index = LookupIndex(max_ngram=max_ngram)
    for cut in sorted(c for c in cuts if c <= len(seq)) + [len(seq)]:
        assert index.propose(seq[:cut], k) == naive_propose(seq[:cut], k, max_ngram)
