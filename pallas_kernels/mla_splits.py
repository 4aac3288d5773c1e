"""How the MLA prefix kernels of tree_mla_attention split each sequence's cached keys, and the checks a split
plan passes.

The Triton prefix kernel takes one split count for every sequence (`choose_num_splits`). The Mosaic kernel
(mla_prefix_mosaic) takes a plan: a tuple of groups (c, first, end) in launch order, each the key blocks
[first, end) of sequence c (`check_plan`), chosen by a list-scheduling model of the GPU (`plan_splits`).
Both choices minimise modelled time in key blocks, where each program also pays a fixed cost.
"""

import functools
import heapq

import numpy as np
from jax.experimental import pallas as pl

# A program's fixed cost in key blocks: queries in, pipeline fill, its 128 KB partial out and the merge's read of it.
_SPLIT_OVERHEAD_BLOCKS = 16
# A group shorter than this (in key blocks) would mostly pay its fixed cost; it bounds how finely the planner cuts.
_MIN_GROUP_BLOCKS = 16


def check_plan(plan, num_seqs, num_key_blocks):
    """Validates a split plan: a tuple of groups (c, first, end) in launch order, each the key blocks
    [first, end) of sequence c's cache as planned for a full cache (num_key_blocks blocks); the groups of a
    sequence, in plan order, cover [0, num_key_blocks) one after another, and its last one also takes the tail."""
    plan = tuple(tuple(int(x) for x in group) for group in plan)
    reached = [0] * num_seqs
    for group in plan:
        if len(group) != 3 or not 0 <= group[0] < num_seqs or group[1] != reached[group[0]] or group[2] < group[1]:
            raise ValueError(
                f"plan: group {group} must be (c, first, end) with c < {num_seqs}, first the end of "
                f"sequence c's previous group (or 0) and end >= first; plan {plan}"
            )
        reached[group[0]] = group[2]
    if reached != [num_key_blocks] * num_seqs:
        raise ValueError(
            f"plan: every sequence's groups must end at its {num_key_blocks} key blocks, "
            f"they reach {reached}; plan {plan}"
        )
    return plan


def sequence_groups(plan, num_seqs):
    """For each sequence c < num_seqs, the indices of its groups in the plan, in order (the last takes the tail)."""
    groups = [[] for _ in range(num_seqs)]
    for g, (c, _, _) in enumerate(plan):
        groups[c].append(g)
    return groups


def partial_slots(plan, num_seqs):
    """int32 [G]: the slot of each group's partial, sequence after sequence (each sequence's groups in plan order),
    so the merge reads a sequence's partials as one contiguous run, whatever order the plan launches them in."""
    slots = np.empty(len(plan), np.int32)
    slots[[g for groups in sequence_groups(plan, num_seqs) for g in groups]] = np.arange(len(plan), dtype=np.int32)
    return slots


def equal_plan(num_splits, num_seqs, num_key_blocks):
    """The plan of num_splits (one count for every sequence, or a tuple with each sequence's) equal splits a
    sequence, sequence after sequence (the last ones empty where a sequence has fewer key blocks than splits)."""
    counts = (num_splits,) * num_seqs if isinstance(num_splits, int) else tuple(num_splits)
    if len(counts) != num_seqs or min(counts) < 1:
        raise ValueError(f"num_splits must be a count >= 1 or {num_seqs} of them (one a sequence), got {num_splits}")
    plan = []
    for c, count in enumerate(counts):
        per_split = pl.cdiv(num_key_blocks, count)
        plan += [
            (c, min(s * per_split, num_key_blocks), min((s + 1) * per_split, num_key_blocks)) for s in range(count)
        ]
    return tuple(plan)


def choose_num_splits(num_programs, num_key_blocks, resident_programs, min_split_blocks=4):
    """Prefix splits per (sequence, m block) minimising waves x per-program work, at most
    ceil(num_key_blocks / min_split_blocks) of them.

    num_programs: C * m blocks (programs per split); num_key_blocks: S_max / block_k; resident_programs:
    programs the GPU runs at once (one wave). A split count that leaves a last, mostly idle wave costs a
    whole wave, so 17 splits of 8 sequences (136 programs on 132 SMs) lose to 16."""

    def cost(splits):
        waves = pl.cdiv(num_programs * splits, resident_programs)
        return waves * (pl.cdiv(num_key_blocks, splits) + _SPLIT_OVERHEAD_BLOCKS), splits

    return min(range(1, max(1, pl.cdiv(num_key_blocks, min_split_blocks)) + 1), key=cost)


def list_schedule_makespan(program_sizes, resident_programs):
    """When the last of the programs (sizes in launch order) ends if each starts on the first free slot of
    resident_programs (how the GPU hands out CTAs)."""
    free_at = [0] * resident_programs
    for size in program_sizes:
        heapq.heappush(free_at, heapq.heappop(free_at) + size)
    return max(free_at)


def _program_sizes(plan, num_m_blocks, num_tail_blocks):
    """The plan's programs in launch order (each group's row tiles side by side), each costing its key blocks (the
    tail's in a sequence's last group) plus `_SPLIT_OVERHEAD_BLOCKS`, or 1 if it has none."""
    tail_groups = {groups[-1] for groups in sequence_groups(plan, 1 + max(c for c, _, _ in plan)) if groups}
    for g, (_, first, end) in enumerate(plan):
        blocks = end - first + (num_tail_blocks if g in tail_groups else 0)
        yield from [blocks + _SPLIT_OVERHEAD_BLOCKS if blocks else 1] * num_m_blocks


def plan_makespan(plan, num_m_blocks, num_tail_blocks, resident_programs):
    """The modelled time of a split plan (`check_plan`), in key blocks."""
    return list_schedule_makespan(_program_sizes(plan, num_m_blocks, num_tail_blocks), resident_programs)


def _fill_plan(num_m_blocks, num_seqs, num_key_blocks, num_tail_blocks, resident_programs, makespan):
    """A plan whose every program ends by `makespan`, or None: the sequence with the most work left takes the next
    group, as long as its latest-starting row tile still ends in time (its tail only with the rest of its cache)."""
    free_at = [0] * resident_programs
    cache_left, tail_left = [num_key_blocks] * num_seqs, [num_tail_blocks] * num_seqs
    plan = []
    while True:
        c = max(range(num_seqs), key=lambda i: (cache_left[i] + tail_left[i], -i))
        if not cache_left[c] + tail_left[c]:
            return tuple(plan)
        starts = [heapq.heappop(free_at) for _ in range(num_m_blocks)]
        room = makespan - _SPLIT_OVERHEAD_BLOCKS - max(starts)
        blocks = min(cache_left[c], room)
        tail = tail_left[c] if cache_left[c] + tail_left[c] <= room else 0
        if not tail and blocks < _MIN_GROUP_BLOCKS:
            return None
        plan.append((c, num_key_blocks - cache_left[c], num_key_blocks - cache_left[c] + blocks))
        cache_left[c], tail_left[c] = cache_left[c] - blocks, tail_left[c] - tail
        for start in starts:
            heapq.heappush(free_at, start + blocks + tail + _SPLIT_OVERHEAD_BLOCKS)


@functools.lru_cache(maxsize=256)
def plan_splits(num_m_blocks, num_seqs, num_key_blocks, num_tail_blocks, resident_programs):
    """The split plan (`check_plan`) for the Mosaic kernel, whose grid launches a group's row
    tiles side by side, then the groups in plan order: the modelled fastest, then the one with fewest groups, of
    equal splits (n a sequence, n from half `choose_num_splits`'s count to all of it) and the greedy plan
    (`_fill_plan`) at the least makespan it meets (binary search). Like every split choice here it plans full
    caches (S_max keys a sequence); the kernel cuts a shorter prefix in the same proportions."""
    args = num_m_blocks, num_tail_blocks, resident_programs
    cost = lambda plan: (plan_makespan(plan, *args), len(plan))
    uniform = choose_num_splits(num_seqs * num_m_blocks, num_key_blocks, resident_programs)
    best = min(
        (equal_plan(n, num_seqs, num_key_blocks) for n in range(max(1, uniform // 2), uniform + 1)),
        key=cost,
    )
    if num_m_blocks > resident_programs:  # a group's tiles would not start together
        return best
    lo, hi = pl.cdiv(num_seqs * num_m_blocks * (num_key_blocks + num_tail_blocks), resident_programs), cost(best)[0] - 1
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if _fill_plan(num_m_blocks, num_seqs, num_key_blocks, *args[1:], mid) else (mid + 1, hi)
    greedy = _fill_plan(num_m_blocks, num_seqs, num_key_blocks, *args[1:], lo)
    return greedy if greedy and cost(greedy) < cost(best) else best
