"""The generation engine's plan, apart from its execution, as vLLM's scheduler: which waiting requests start, how
many prompt tokens each prefill takes this turn, which cohort a prefilled row joins (or whether it starts one), how a
ragged cohort's buffers are sized, which cohorts merge, and where the rows that stay go when others leave.

Every decision is a pure function of the engine's state given as plain numbers -- each request's KV need (prompt +
max_new_tokens), prompt lengths and prefill progress, each cohort's alignment key (what its rows must share to step
together) -- and of the cache layout's rules: no model, no threads, no arrays of logits. So the rules are tested over
many arrival orders without a model (tests/serving/test_scheduler.py), and ``GenerationEngine``
(``serving.engine``) only runs them on its ``KVCacheStepper``: it asks the plan at the moment it acts, because what
happens next (a row that ends on its first token joins nothing) depends on the tokens the model chooses.

The rules:

- **Admission.** Waiting requests start in arrival order while the KV budget and ``max_running`` hold them; the first
  that does not fit waits, and so do those behind it (a long request is not starved by short ones passing it). A
  request that could never fit alone is refused at submit (``fits_alone``); one that fits alone waits at most until
  the rows before it leave.
- **Budget** (``KVBudget``): planned from needs, never from what a row happens to use. Where rows of any length share
  a cohort every row is as wide as the widest (rows x the largest need; a ragged cohort's buffers are that wide too);
  in cohorts of one length each row holds its own (the sum of needs).
- **Cohorts.** Where lengths mix (``mix_lengths``: holes the file masks and positions it counts per row, or a ragged
  cache) every row joins the first cohort; otherwise a row joins only a cohort of its exact alignment key (cache
  width, and an encoder-decoder's source length when its decoder cannot mask a shorter one), else starts its own,
  and cohorts whose keys meet after a step merge.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

# What rows must share to step together unmixed: (cache width, source length a decoder cannot mask, else 0).
AlignmentKey = tuple[int, int]


class KVBudget:
    """Which requests may run at once within ``max_kv_tokens`` cache positions: a pure function of their needs.

    ``mixed``: one cohort, every row as wide as the widest possible row (rows x max need); otherwise each row holds
    its own length (sum of needs)."""

    def __init__(self, max_kv_tokens: int, mixed: bool):
        self.max_kv_tokens = max_kv_tokens
        self.mixed = mixed

    def planned(self, needs: Sequence[int]) -> int:
        if not needs:
            return 0
        return len(needs) * max(needs) if self.mixed else sum(needs)

    def fits(self, needs: Sequence[int], need: int) -> bool:
        return self.planned([*needs, need]) <= self.max_kv_tokens


@dataclass(frozen=True)
class Prefilling:
    """A request whose prompt is being prefilled: ``prefilled`` of its ``prompt_length`` tokens are in its cache."""

    prompt_length: int
    prefilled: int = 0


@dataclass(frozen=True)
class PrefillChunk:
    """Prompt tokens ``start`` to ``start + length`` of the ``index``-th prefilling request run this turn."""

    index: int
    start: int
    length: int


@dataclass(frozen=True)
class CohortBuffers:
    """Buffers a ragged cohort must hold before a row joins: ``rows`` rows of ``positions`` positions."""

    positions: int
    rows: int


class Scheduler:
    """The engine's rules over its limits and the cache layout (see the module's doc).

    ``whole_prompts``: a prompt is prefilled in one call whatever ``prefill_chunk`` says (an encoder reads its whole
    source at once). ``ragged``: the cache keeps each row at its own length (joins into spare rows, swap-removal)."""

    def __init__(self, *, max_kv_tokens: int, max_running: int, prefill_chunk: int, mix_lengths: bool,
                 ragged: bool = False, whole_prompts: bool = False):
        self.budget = KVBudget(max_kv_tokens, mix_lengths)
        self.max_running = max_running
        self.prefill_chunk = prefill_chunk
        self.mix_lengths = mix_lengths
        self.ragged = ragged
        self.whole_prompts = whole_prompts

    def fits_alone(self, need: int) -> bool:
        """Whether a request of this KV need could ever run here; one that cannot is refused, not queued."""
        return self.budget.fits([], need)

    def admitted(self, waiting: Sequence[int], running: Sequence[int]) -> int:
        """How many requests at the head of the queue start now: ``waiting`` the queued requests' needs in arrival
        order, ``running`` the needs of those already started (prefilling or in a cohort)."""
        needs = list(running)
        count = 0
        for need in waiting:
            if len(needs) >= self.max_running or not self.budget.fits(needs, need):
                break  # FIFO: the requests behind the head wait with it
            needs.append(need)
            count += 1
        return count

    def prefill_chunks(self, prefilling: Sequence[Prefilling]) -> list[PrefillChunk]:
        """This turn's prefill, oldest request first, within ``prefill_chunk`` prompt tokens; the first chunk runs
        whatever its size (an encoder's whole source), so that every turn makes progress."""
        left = self.prefill_chunk
        chunks = []
        for index, request in enumerate(prefilling):
            if left <= 0:
                break
            wanted = request.prompt_length if self.whole_prompts else left
            length = min(wanted, request.prompt_length - request.prefilled)
            chunks.append(PrefillChunk(index, request.prefilled, length))
            left -= length
        return chunks

    def cohort_for(self, key: AlignmentKey, cohorts: Sequence[AlignmentKey]) -> int | None:
        """Which running cohort a prefilled row of alignment ``key`` joins (an index into ``cohorts``, their keys in
        order), or None: it starts a cohort of its own."""
        for index, cohort in enumerate(cohorts):
            if self.mix_lengths or cohort == key:
                return index
        return None

    def cohort_buffers(self, needs: Sequence[int], row_capacity: int, capacity: int) -> CohortBuffers | None:
        """Buffers a ragged cohort needs before a row joins: ``needs`` its rows' needs with the joining row's,
        ``row_capacity`` x ``capacity`` what it holds now. None: they fit (no copy). Else positions for the longest
        need, rows doubling (so that joins mostly fill spare rows and move nothing) but never past ``max_running``
        or what ``max_kv_tokens`` holds at that width; the budget already admitted the rows, so rows x positions
        stays within it. New buffers are as wide as the rows now need, narrower than before when the longest
        request has left."""
        rows = len(needs)
        positions = max(needs)
        if row_capacity >= rows and capacity >= positions:
            return None
        room = max(rows, self.budget.max_kv_tokens // positions)
        return CohortBuffers(positions, min(max(rows, 2 * row_capacity), self.max_running, room))

    def merges(self, cohorts: Sequence[AlignmentKey]) -> list[tuple[int, int]]:
        """Cohorts that step as one from now on, as (merged, into) indices into ``cohorts`` (their keys in order),
        each merged cohort's rows appended to the first cohort of its key in that order. Cohorts of one key hold rows
        of one length (no holes), so one call can step them all; where lengths mix there is one cohort already."""
        if self.mix_lengths:
            return []
        first: dict[AlignmentKey, int] = {}
        merged = []
        for index, key in enumerate(cohorts):
            into = first.setdefault(key, index)
            if into != index:
                merged.append((index, into))
        return merged

    def rows_kept(self, rows: int, leaving: Collection[int]) -> list[int]:
        """The rows of a cohort of ``rows`` that stay when the rows at ``leaving`` go, in their new order (empty: the
        cohort ends). A ragged cache swap-removes: each leaving row's place goes to the last row, so a departure
        moves one row, not all; with holes the cache is copied anyway, and the rows keep their order."""
        if not self.ragged:
            return [i for i in range(rows) if i not in leaving]
        order = list(range(rows))
        for i in sorted(leaving, reverse=True):
            order[i] = order[-1]
            order.pop()
        return order
