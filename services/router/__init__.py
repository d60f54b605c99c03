"""The router: CoSine's control plane (see DESIGN.md), one module per concept.

- ``server.py``: the gRPC servicer (thin: protobuf in and out, status codes); ``inprocess.py`` the
  same core driven in one process.
- ``core.py``: the rounds (gate, route, draft, plan, verify, apply), pipelined; ``ahead.py`` the
  drafter work they start off the verifier's path (drafting ahead, routing ahead); ``feedback.py``
  what a round teaches the router (pass times, counters, metrics); ``frontiers.py`` a draft verified
  chunk by chunk, the next chunk drafted beside the pass and pruned unverified after a rejection.
- ``yield_guard.py``: speculation only where it is measured to commit more tokens a second than
  plain decoding, per load level (epochs of either arm; the losing one as a control group).
- ``pool.py``: the request pool (submission, cancellation, hand-back after a round, finishing);
  ``requests.py`` its types and the contracts of the drafter pool and the verifier;
  ``admission.py`` checks a submission; ``resume.py`` re-prefills requests after a verifier restart.
- ``scheduler.py``: batches under the verify-token budget, speculation length, load control, and the
  plain steps of a round that drafts nothing (the verifier decodes several tokens before it answers).
- ``gate.py``: which requests the drafter models draft for (and the probes of those that do not).
- ``domain.py``: a request's domain (the shared lexicon, ``lexicon.py``, else the drafters' scores)
  and its routing vector (``routing.py``, from the expertise profiles, ``profiles.py``).
- ``drafting.py``: drafter selection and token or chunk fusion (``common/spec/fusion.py`` builds the
  trees, ``common/spec/token_fusion.py`` runs token fusion's steps, here or inside a drafter process);
  ``clients.py`` and ``replicas.py`` reach the drafters.
- ``lookup_drafting.py``: the lookup drafter's chains (``lookup.py``: from a request's own text;
  ``common/spec/lookup_corpus.py``: from the corpus the target wrote).
- ``pass_plan.py``: the batch's trees cut to what pays on the measured pass-time curve;
  ``control.py`` prices nodes, draft steps, drafting ahead and pipelining against their cost.
- ``verdicts.py``: a verdict applied (commit, credit, calibrations, profile updates);
  ``matching.py`` pairs verdicts with requests.
- ``settings.py``: the router's settings; ``metrics.py`` its Prometheus series.
"""
