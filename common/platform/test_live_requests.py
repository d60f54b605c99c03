from common.platform.live_requests import LiveRequests


def test_a_refused_release_keeps_the_request_live():
    live = LiveRequests()
    before = live.begin([("x", False), ("x", True)])
    live.settle(before, [("x", False, True), ("x", True, False)])  # the repeat (a release) was refused
    assert live.ids == {"x"}


def test_a_successful_release_frees_and_a_refused_new_request_is_never_held():
    live = LiveRequests()
    live.settle(live.begin([("x", False)]), [("x", False, True)])
    before = live.begin([("x", True), ("bad", False)])
    assert live.ids == {"x", "bad"}  # while the pass runs, everything it may create counts
    live.settle(before, [("x", True, True), ("bad", False, False)])
    assert live.ids == set() and not live


def test_a_refusal_leaves_a_live_request_live_and_the_last_success_decides():
    live = LiveRequests()
    live.settle(live.begin([("x", False)]), [("x", False, True)])
    live.settle(live.begin([("x", False)]), [("x", False, False)])  # e.g. context too long: request unchanged
    assert live.ids == {"x"}
    live.settle(live.begin([("y", True), ("y", False)]), [("y", True, True), ("y", False, True)])
    assert live.ids == {"x", "y"}


def test_keys_may_be_tuples():
    live = LiveRequests()
    live.settle(
        live.begin([(("code", "r"), False), (("prose", "r"), False)]),
        [(("code", "r"), False, True), (("prose", "r"), False, False)],
    )
    assert live.ids == {("code", "r")}
