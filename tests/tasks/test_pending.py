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
