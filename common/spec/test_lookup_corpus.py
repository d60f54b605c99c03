"""The lookup corpus: what it proposes (unit and property tests)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from common.spec.lookup_corpus import DomainCorpora, LookupCorpus


def test_the_longest_match_wins_and_a_proposal_stops_at_the_end_of_its_sequence():
    corpus = LookupCorpus(min_match=2, max_match=8)
    corpus.extend([[1, 2, 3, 4, 5, 6], [9, 2, 3, 7, 8], [5, 5, 2, 3]])
    # "2 3" occurs three times; only the first occurrence is preceded by "1"
    assert corpus.propose([0, 1, 2, 3], 3) == ([4, 5, 6], 3)
    # "9 2 3": the second sequence, whose tokens end after two
    assert corpus.propose([9, 2, 3], 4) == ([7, 8], 3)
    # a tie on length: the latest occurrence that has tokens after it ("5 2 3" ends its sequence)
    assert corpus.propose([4, 2, 3], 2) == ([7, 8], 2)
    assert corpus.propose([7, 7], 3) == ([], 0)  # no bigram match
    assert corpus.propose([2, 3], 0) == ([], 0)
    assert len(corpus) == 15 and corpus.sequences == 3


def test_among_matches_as_long_the_majority_continuation_is_proposed():
    corpus = LookupCorpus(min_match=2, max_match=8)
    corpus.extend([[1, 2, 3, 4, 5], [7, 2, 3, 4, 6], [8, 2, 3, 9, 9]])
    # "2 3" is followed by 4 twice and by 9 once (the latest); after "2 3 4", by 5 and 6 once each
    # (the latest of those two, 6, on the tie)
    assert corpus.propose([0, 2, 3], 3) == ([4, 6], 2)
    # a longer match still wins over a majority
    assert corpus.propose([8, 2, 3], 2) == ([9, 9], 3)


def test_a_full_corpus_takes_no_more_sequences():
    corpus = LookupCorpus(max_tokens=10)
    assert corpus.extend([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11]]) == 2
    assert corpus.propose([5, 6], 2) == ([7, 8], 2) and corpus.propose([9, 10], 1) == ([], 0)


def test_a_request_looks_in_its_domain_s_text_or_in_all_of_it():
    corpora = DomainCorpora.build({"code": [[1, 2, 3, 40]], "prose": [[1, 2, 3, 50]]})
    assert corpora.propose("code", [1, 2, 3], 1) == ([40], 3)
    assert corpora.propose("prose", [1, 2, 3], 1) == ([50], 3)
    assert corpora.propose("", [1, 2, 3], 1)[0] in ([40], [50])  # no domain: every domain's text
    assert corpora.sequences == 2


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    st.lists(st.lists(st.integers(0, 5), min_size=0, max_size=30), min_size=1, max_size=6),
    st.lists(st.integers(0, 5), min_size=0, max_size=12),
    st.integers(1, 6),
)
def test_a_proposal_is_what_followed_a_real_occurrence_of_the_suffix(sequences, query, k):
    """Whatever the text: the proposal is the tokens that followed an occurrence, in one corpus
    sequence, of the query's last ``match`` tokens; and no longer match exists."""
    corpus = LookupCorpus(min_match=2, max_match=5, max_candidates=1000)
    corpus.extend(sequences)
    got, match = corpus.propose(query, k)
    longest = 0
    for seq in sequences:
        if len(seq) <= corpus.min_match:
            continue
        for end in range(corpus.min_match, len(seq)):  # seq[end] follows the occurrence ending before it
            n = 0
            while n < min(5, len(query), end) and seq[end - n - 1] == query[-n - 1]:
                n += 1
            if n >= corpus.min_match:
                longest = max(longest, n)
    if not got:
        assert match == 0 and (longest == 0 or k == 0)
        return
    assert match == longest and 1 <= len(got) <= k
    assert any(
        seq[end - match : end] == query[-match:] and seq[end : end + len(got)] == got
        for seq in sequences
        if len(seq) > corpus.min_match
        for end in range(match, len(seq))
    )
