"""The scheduler's books for loads that end inside their step (``connectors/vllm/scheduling.py``),
on stand-ins for vLLM's request states: vLLM-free."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from offload_engine.connectors.vllm.scheduling import InStepLoads, LayerwiseScheduling


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


@dataclass
class Block:
    block_id: int
    block_hash: object = "cached"
    is_null: bool = False


@dataclass
class Blocks:
    blocks: tuple[list[Block], ...]


@dataclass
class Group:
    group_idx: int
    tokens_per_block: int


def test_a_hit_shows_its_blocks_past_the_local_prefix_as_fresh_at_allocation() -> None:
    scheduling = LayerwiseScheduling()
    blocks = Blocks(([Block(i) for i in range(4)], [Block(10 + i) for i in range(2)]))
    groups = [Group(0, 16), Group(1, 32)]
    scheduling.hit("r", 32)
    shown = scheduling.allocated("r", blocks, 64, groups)
    assert [b.block_hash for b in shown.blocks[0]] == ["cached", "cached", None, None]
    assert [b.block_hash for b in shown.blocks[1]] == ["cached", None]
    assert [b.block_id for b in shown.blocks[0]] == [0, 1, 2, 3]
    assert blocks.blocks[0][2].block_hash == "cached"  # vLLM's own blocks are untouched
    # the hit is used up: a second allocation of the request is vLLM's as it is
    assert scheduling.allocated("r", blocks, 64, groups) is blocks


def test_no_hit_or_no_external_tokens_leave_the_blocks_as_they_are() -> None:
    scheduling = LayerwiseScheduling()
    blocks = Blocks(([Block(0)],))
    assert scheduling.allocated("r", blocks, 16, [Group(0, 16)]) is blocks
    scheduling.hit("r", 0)
    assert scheduling.allocated("r", blocks, 0, [Group(0, 16)]) is blocks


def test_a_finished_request_forgets_its_unallocated_hit() -> None:
    scheduling = LayerwiseScheduling()
    scheduling.hit("r", 16)
    scheduling.finished("r")
    blocks = Blocks(([Block(0), Block(1)],))
    assert scheduling.allocated("r", blocks, 32, [Group(0, 16)]) is blocks
    assert repr(scheduling) == "<LayerwiseScheduling hits=[] <InStepLoads pending=[]>>"


def test_building_a_step_hides_its_loads_and_the_earlier_ones_then_puts_them_back() -> None:
    scheduling = LayerwiseScheduling()
    states = {"a": State({1}), "b": State({2, 5})}
    jobs = {1: "load", 2: "load", 5: "store"}
    with scheduling.building(states, jobs, [(1, "a")]):
        assert states["a"].transfer_jobs == set()
    with scheduling.building(states, jobs, [(2, "b")]):  # load 1 is still not reported
        assert states["a"].transfer_jobs == set() and states["b"].transfer_jobs == {5}
    assert states["a"].transfer_jobs == {1} and states["b"].transfer_jobs == {2, 5}
    assert len(scheduling.in_step) == 2
