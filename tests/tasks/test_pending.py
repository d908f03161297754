"""``tasks.stream.PendingRequests``: the requests an engine actor holds, as the Ray feeder tracks them."""

from __future__ import annotations

import pytest

from reflow.storage.schema import GenRequest, GenResult


def result(request_id: str, tokens: int) -> GenResult:
    return GenResult(request_id, [7] * tokens, [-0.5] * tokens, "stop", [0] * tokens, 0)


@pytest.mark.slow
def test_an_engine_is_credited_only_what_it_generated_of_a_moved_request(local_ray) -> None:
    import ray

    from reflow.tasks.stream import PendingRequests

    @ray.remote
    class Engine:
        def incarnation(self) -> str:
            return "first"

        def submit(self, requests) -> None:
            self.requests = requests

    pending = PendingRequests(Engine.remote())
    fresh = GenRequest("g0/p0/0", [1, 2], max_tokens=16)
    moved = GenRequest("g0/p0/1", [1, 2], max_tokens=16).resumed(result("g0/p0/1", 5))  # 5 from another engine
    pending.submit([fresh, moved])
    assert pending.new_tokens(result("g0/p0/0", 9)) == 9
    assert pending.new_tokens(result("g0/p0/1", 12)) == 7


@pytest.mark.slow
def test_a_release_lapses_once_the_engine_holds_nothing_and_given_back_requests_are_not_reissued(local_ray) -> None:
    """A flex worker's release is asked for as it moves to training; if its window finishes everything first, the
    ask lapses: kept, it gave back the first requests of the worker's next turn at generation before a token of them
    was generated (seen in a run: 8 fresh requests given back at each return to generation)."""
    import ray

    from reflow.storage.schema import Drain
    from reflow.tasks.stream import PendingRequests

    @ray.remote
    class Engine:
        def __init__(self) -> None:
            self.submitted: list[list[str]] = []

        def incarnation(self) -> str:
            return "first"

        def submit(self, requests) -> None:
            self.submitted.append([r.request_id for r in requests])

        def seen(self) -> list[list[str]]:
            return self.submitted

    engine = Engine.remote()
    pending = PendingRequests(engine)
    pending.submit([GenRequest(f"g0/p0/{k}", [1, 2], max_tokens=16) for k in range(3)])
    pending.release = True
    pending.drained(Drain([result("g0/p0/0", 4)], seconds=0.1, in_flight=2, incarnation="first"))
    assert pending.release  # two still held: the next window gives them back
    aborted = GenResult("g0/p0/1", [7, 7], [-0.5] * 2, "abort", [0, 0], 0)
    pending.drained(Drain([], seconds=0.1, in_flight=1, incarnation="second", released=[aborted]))
    assert set(pending.requests) == {"g0/p0/2"}  # the one given back is not re-issued to the restarted engine
    assert ray.get(engine.seen.remote())[-1] == ["g0/p0/2"]
    assert pending.release
    pending.drained(Drain([result("g0/p0/2", 6)], seconds=0.1, in_flight=0, incarnation="second"))
    assert not pending.requests and not pending.release  # held nothing: the ask lapsed

    pending.submit([GenRequest("g1/p0/0", [1, 2], max_tokens=16)])  # on its way, not yet in a window
    pending.release = True
    pending.drained(Drain([], seconds=0.0, in_flight=0, incarnation="second"))
    assert pending.release  # the next window gives it back
