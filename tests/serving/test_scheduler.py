"""The generation engine's plan (serving.scheduler) without a model: hand-written cases of each rule, and 200 seeded
scenarios of arrivals, lengths and budgets run turn by turn through the rules the way the engine runs them, with
rows as plain numbers (a decode step lengthens every row by one), checking after every turn what the engine relies
on: the budget holds, nothing is both waiting and running, arrival order is kept, what fits alone runs and ends,
and rows of different lengths never share a cohort where the file cannot mix them."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np
import pytest

from mha_deploy.serving.scheduler import CohortBuffers, KVBudget, PrefillChunk, Prefilling, Scheduler


def scheduler(**overrides) -> Scheduler:
    options = dict(max_kv_tokens=100, max_running=8, prefill_chunk=16, mix_lengths=True)
    return Scheduler(**{**options, **overrides})


# --- each rule, by hand ---------------------------------------------------------------------------------------


def test_admission_keeps_arrival_order_a_long_head_holds_the_short_ones_behind_it():
    plan = scheduler(mix_lengths=False)
    assert plan.admitted([30, 30, 30, 5], running=[20]) == 2  # 20 + 30 + 30 = 80; a third would pass 100
    assert plan.admitted([90, 5, 5], running=[20]) == 0  # the head waits, and the short ones with it
    assert plan.admitted([90, 5, 5], running=[]) == 3
    assert plan.admitted([], running=[50]) == 0


def test_admission_stops_at_max_running_and_plans_a_mixed_cohort_as_wide_as_its_widest_row():
    assert scheduler(max_running=3).admitted([1] * 5, running=[1]) == 2
    mixed = scheduler(max_kv_tokens=100)
    assert mixed.admitted([10, 10, 10], running=[40]) == 1  # 2 x 40 fits, 3 x 40 does not
    assert scheduler(max_kv_tokens=100, mix_lengths=False).admitted([10, 10, 10], running=[40]) == 3


def test_a_request_is_refused_only_when_it_could_never_fit_alone():
    plan = scheduler(max_kv_tokens=40)
    assert plan.fits_alone(40) and not plan.fits_alone(41)
    assert KVBudget(100, mixed=True).planned([]) == 0


def test_prefill_takes_the_oldest_prompts_first_within_the_chunk():
    plan = scheduler(prefill_chunk=7)
    chunk = PrefillChunk
    assert plan.prefill_chunks([Prefilling(5), Prefilling(11), Prefilling(3)]) == [chunk(0, 0, 5), chunk(1, 0, 2)]
    assert plan.prefill_chunks([Prefilling(11, 2), Prefilling(3)]) == [chunk(0, 2, 7)]
    assert plan.prefill_chunks([Prefilling(11, 9), Prefilling(3)]) == [chunk(0, 9, 2), chunk(1, 0, 3)]
    assert plan.prefill_chunks([]) == []


def test_an_encoders_source_is_prefilled_whole_past_the_chunk():
    plan = scheduler(prefill_chunk=4, whole_prompts=True)
    chunk = PrefillChunk
    assert plan.prefill_chunks([Prefilling(9), Prefilling(2)]) == [chunk(0, 0, 9)]
    assert plan.prefill_chunks([Prefilling(2), Prefilling(9), Prefilling(1)]) == [chunk(0, 0, 2), chunk(1, 0, 9)]


def test_a_row_joins_the_first_cohort_where_lengths_mix_else_only_its_own_key():
    keys = [(5, 0), (7, 0), (7, 3)]
    assert scheduler().cohort_for((9, 0), keys) == 0
    assert scheduler().cohort_for((9, 0), []) is None
    aligned = scheduler(mix_lengths=False)
    assert aligned.cohort_for((7, 0), keys) == 1
    assert aligned.cohort_for((7, 3), keys) == 2  # an unmasked source must match too
    assert aligned.cohort_for((6, 0), keys) is None


def test_cohorts_merge_into_the_first_of_their_key_and_never_where_lengths_mix():
    keys = [(5, 0), (6, 0), (5, 0), (6, 0), (7, 0), (5, 0)]
    assert scheduler(mix_lengths=False).merges(keys) == [(2, 0), (3, 1), (5, 0)]
    assert scheduler(mix_lengths=False).merges([(5, 0), (5, 1)]) == []
    assert scheduler().merges(keys) == []


def test_leaving_rows_keep_order_with_holes_and_swap_in_the_last_row_when_ragged():
    assert scheduler().rows_kept(5, {1, 3}) == [0, 2, 4]
    ragged = scheduler(ragged=True)
    assert ragged.rows_kept(5, {1}) == [0, 4, 2, 3]  # row 4 took row 1's place; 0, 2, 3 did not move
    assert ragged.rows_kept(5, {1, 3}) == [0, 4, 2]
    assert ragged.rows_kept(5, {4}) == [0, 1, 2, 3]
    assert ragged.rows_kept(3, {0, 1, 2}) == scheduler().rows_kept(3, {0, 1, 2}) == []


def test_a_ragged_cohort_keeps_buffers_that_fit_and_doubles_its_rows_within_the_limits():
    plan = scheduler(max_kv_tokens=100, max_running=8, ragged=True)
    assert plan.cohort_buffers([10, 20], row_capacity=2, capacity=20) is None
    assert plan.cohort_buffers([10, 20, 5], row_capacity=2, capacity=20) == CohortBuffers(20, 4)
    assert plan.cohort_buffers([10, 30], row_capacity=2, capacity=20) == CohortBuffers(30, 3)  # 100 // 30 rows
    assert plan.cohort_buffers([10], row_capacity=0, capacity=0) == CohortBuffers(10, 1)
    # the longest request left: the new buffers are narrower, and max_running caps the doubling
    assert scheduler(max_running=3, ragged=True).cohort_buffers([1, 1, 1], 2, 4) == CohortBuffers(1, 3)


# --- the rules over many arrival orders -----------------------------------------------------------------------

# How rows share a cache, as the engine's stepper decides: a holes file that mixes lengths (position_ids), one that
# counts positions over the cache width (rows of one length only), a ragged file, and an encoder-decoder whose
# decoder cannot mask a shorter source (rows of one target length and one source length only).
LAYOUTS = {
    "holes-mixed": dict(mix_lengths=True),
    "holes-aligned": dict(mix_lengths=False),
    "ragged": dict(mix_lengths=True, ragged=True),
    "encoder-decoder-aligned": dict(mix_lengths=False, whole_prompts=True),
}


@dataclass(eq=False)
class Row:
    """A request as the plan sees it, and what the model would do with it: end after ``stops_after`` tokens."""

    id: int
    prompt: int
    max_new: int
    stops_after: int
    source: int
    prefilled: int = 0
    generated: int = 0

    @property
    def need(self) -> int:
        return self.prompt + self.max_new

    def key(self, encoder_decoder: bool) -> tuple[int, int]:
        """The alignment key its stepper would report: its cache width (a decoder's prompt and the tokens stepped
        since; an encoder-decoder's target tokens from the start token) and its unmasked source length."""
        if encoder_decoder:
            return self.generated, self.prompt
        return self.prompt + self.generated - 1, 0


@dataclass(eq=False)
class Cohort:
    rows: list[Row]
    row_capacity: int = 0
    capacity: int = 0


def scenario(seed: int) -> tuple[dict, list[tuple[int, Row]]]:
    rng = np.random.default_rng(seed)
    limits = dict(max_kv_tokens=int(rng.integers(8, 160)), max_running=int(rng.integers(1, 9)),
                  prefill_chunk=int(rng.integers(1, 17)))
    arrivals = []
    for i in range(int(rng.integers(1, 21))):
        prompt, max_new = int(rng.integers(1, 21)), int(rng.integers(1, 21))
        stops_after = int(rng.integers(1, max_new + 1)) if rng.random() < 0.5 else max_new  # an end id comes early
        arrivals.append((int(rng.integers(0, 12)), Row(i, prompt, max_new, stops_after, source=prompt)))
    arrivals.sort(key=lambda arrival: arrival[0])  # ids in arrival order, as the engine counts them
    for i, (_, row) in enumerate(arrivals):
        row.id = i
    return limits, arrivals


def serve(plan: Scheduler, arrivals: list[tuple[int, Row]], encoder_decoder: bool) -> dict:
    """The engine's turn over plain rows, every decision the plan's, checking the invariants after each step."""
    pending = deque(arrivals)
    waiting: deque[Row] = deque()
    prefilling: list[Row] = []
    cohorts: list[Cohort] = []
    started, finished, refused = [], [], []
    waited = most_cohorts = 0
    budget = plan.budget

    def running() -> list[Row]:
        return [*prefilling, *(r for c in cohorts for r in c.rows)]

    def cohort_key(cohort: Cohort) -> tuple[int, int]:
        keys = [r.key(encoder_decoder) for r in cohort.rows]
        return max(k[0] for k in keys), max(k[1] for k in keys)

    def check() -> None:
        active = running()
        assert budget.planned([r.need for r in active]) <= budget.max_kv_tokens
        assert len(active) <= plan.max_running
        ids = [r.id for r in active] + [r.id for r in waiting] + [r.id for r in finished]
        assert len(ids) == len(set(ids)), "a request in two places"
        if plan.mix_lengths:
            assert len(cohorts) <= 1
        else:
            for cohort in cohorts:
                assert len({r.key(encoder_decoder) for r in cohort.rows}) == 1, "rows of other lengths share a cohort"
        if plan.ragged:
            assert sum(c.row_capacity * c.capacity for c in cohorts) <= budget.max_kv_tokens

    for turn in range(10_000):
        if not (pending or waiting or prefilling or cohorts):
            break
        while pending and pending[0][0] <= turn:
            row = pending.popleft()[1]
            (waiting if plan.fits_alone(row.need) else refused).append(row)
        count = plan.admitted([r.need for r in waiting], [r.need for r in running()])
        for _ in range(count):
            started.append(waiting.popleft())
            prefilling.append(started[-1])
        if waiting:  # the head waits only for room: rows full, or the budget
            head = waiting[0]
            assert len(running()) >= plan.max_running or not budget.fits([r.need for r in running()], head.need)
            waited += 1
        check()

        chunks = plan.prefill_chunks([Prefilling(r.prompt, r.prefilled) for r in prefilling])
        assert [c.index for c in chunks] == list(range(len(chunks)))  # oldest first, none skipped
        if prefilling:
            assert chunks and all(c.length > 0 for c in chunks)
        if not plan.whole_prompts:
            assert sum(c.length for c in chunks) <= plan.prefill_chunk
        for chunk, row in zip(chunks, list(prefilling), strict=False):
            assert chunk.start == row.prefilled
            row.prefilled += chunk.length
            assert row.prefilled <= row.prompt
            if plan.whole_prompts:
                assert row.prefilled == row.prompt
            if row.prefilled < row.prompt:
                continue
            prefilling.remove(row)
            row.generated = 1  # its first token, from the prefill's logits
            if row.generated >= row.stops_after:
                finished.append(row)
                continue
            index = plan.cohort_for(row.key(encoder_decoder), [cohort_key(c) for c in cohorts])
            if index is None:
                cohorts.append(Cohort([]))
            target = cohorts[-1 if index is None else index]
            if plan.ragged:
                needs = [r.need for r in [*target.rows, row]]
                buffers = plan.cohort_buffers(needs, target.row_capacity, target.capacity)
                if buffers is not None:
                    assert buffers.rows >= len(needs) and buffers.positions == max(needs)
                    assert buffers.rows <= plan.max_running
                    target.row_capacity, target.capacity = buffers.rows, buffers.positions
                assert target.row_capacity >= len(needs) and target.capacity >= max(needs)
            target.rows.append(row)
            check()

        for cohort in list(cohorts):
            for row in cohort.rows:
                row.generated += 1
                assert row.prompt + row.generated - 1 <= row.need  # the cache never outgrows the planned need
            leaving = {i for i, r in enumerate(cohort.rows) if r.generated >= r.stops_after}
            if not leaving:
                continue
            finished.extend(cohort.rows[i] for i in sorted(leaving))
            kept = plan.rows_kept(len(cohort.rows), leaving)
            assert sorted(kept) == [i for i in range(len(cohort.rows)) if i not in leaving]
            if plan.ragged:  # swap-removal: a departure moves at most one row per leaving row
                assert sum(1 for place, row in enumerate(kept) if place != row) <= len(leaving)
            else:  # holes: the cache is copied anyway, and the rows keep their order
                assert kept == sorted(kept)
            cohort.rows = [cohort.rows[i] for i in kept]
            if not cohort.rows:
                cohorts.remove(cohort)
        for merged, into in plan.merges([cohort_key(c) for c in cohorts]):
            assert merged > into and cohort_key(cohorts[merged]) == cohort_key(cohorts[into])
            cohorts[into].rows.extend(cohorts[merged].rows)
            cohorts[merged].rows = []
        cohorts = [c for c in cohorts if c.rows]
        most_cohorts = max(most_cohorts, len(cohorts))
        if not plan.mix_lengths:
            assert len({cohort_key(c) for c in cohorts}) == len(cohorts), "aligned cohorts left unmerged"
        check()
    else:
        raise AssertionError("the requests never all ended")
    return dict(started=started, finished=finished, refused=refused, waited=waited, most_cohorts=most_cohorts)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_plan_holds_the_budget_order_and_cohort_rules_over_many_arrival_orders(layout):
    options = LAYOUTS[layout]
    encoder_decoder = options.get("whole_prompts", False)
    waited = most_cohorts = 0
    for seed in range(50):  # 4 layouts x 50: 200 scenarios
        limits, arrivals = scenario(seed)
        plan = Scheduler(**limits, **options)
        served = serve(plan, arrivals, encoder_decoder)
        rows = [row for _, row in arrivals]
        assert [r.id for r in served["started"]] == sorted(r.id for r in served["started"])  # FIFO
        assert all(not plan.fits_alone(r.need) for r in served["refused"])  # what fits alone is never refused
        assert {r.id for r in served["finished"]} == {r.id for r in rows if plan.fits_alone(r.need)}
        assert all(r.generated == r.stops_after for r in served["finished"])
        waited += served["waited"]
        most_cohorts = max(most_cohorts, served["most_cohorts"])
    assert waited  # the scenarios did queue requests behind the budget
    assert (most_cohorts == 1) == options["mix_lengths"]  # and rows of other lengths did run side by side
