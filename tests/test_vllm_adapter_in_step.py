"""The scheduler's books for loads that end inside their step (``connectors/vllm/in_step.py``),
on stand-ins for vLLM's request states: vLLM-free."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from offload_engine.connectors.vllm.in_step import InStepLoads


@dataclass
class State:
    transfer_jobs: set[int] = field(default_factory=set)


def test_loads_are_out_of_the_books_only_while_the_step_is_built() -> None:
    books = InStepLoads()
    states = {"a": State({1, 2}), "b": State({3})}
    jobs = {1: "load", 2: "store", 3: "load"}
    books.scheduled([(1, "a"), (3, "b")])
    with books.hidden(states, jobs):
        assert states["a"].transfer_jobs == {2} and states["b"].transfer_jobs == set()
    assert states["a"].transfer_jobs == {1, 2} and states["b"].transfer_jobs == {3}
    assert len(books) == 2


def test_a_reported_load_is_forgotten_and_not_put_back() -> None:
    books = InStepLoads()
    states = {"a": State({1})}
    jobs = {1: "load"}
    books.scheduled([(1, "a")])
    # the workers' report: vLLM removes the job from its books
    del jobs[1]
    states["a"].transfer_jobs.discard(1)
    with books.hidden(states, jobs):
        pass
    assert states["a"].transfer_jobs == set() and len(books) == 0
    # reported while the step was built (a reset clears the jobs): not put back either
    states["a"].transfer_jobs.add(4)
    jobs[4] = "load"
    books.scheduled([(4, "a")])
    with books.hidden(states, jobs):
        jobs.clear()
    assert states["a"].transfer_jobs == set()


def test_a_request_dropped_while_its_load_was_out_gets_its_state_back() -> None:
    """vLLM drops a finished request's state once nothing of it is pending: the load
    still is, so the state comes back until the report removes the job."""
    books = InStepLoads()
    state = State({7})
    states = {"a": state}
    jobs = {7: "load"}
    books.scheduled([(7, "a")])
    with books.hidden(states, jobs):
        assert not state.transfer_jobs
        del states["a"]
    assert states["a"] is state and state.transfer_jobs == {7}


def test_the_books_are_restored_when_building_the_step_raises() -> None:
    books = InStepLoads()
    states = {"a": State({1})}
    books.scheduled([(1, "a")])
    with pytest.raises(RuntimeError), books.hidden(states, {1: "load"}):
        raise RuntimeError("build failed")
    assert states["a"].transfer_jobs == {1}
    assert repr(books) == "<InStepLoads pending=[1]>"
