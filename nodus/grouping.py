"""Splitting jobs into phase-offset groups (or timeslice stacks), balanced by predicted work.

Rule (longest-processing-time first): sort jobs by predicted tokens per step times steps,
largest first (ties by job order), and give each to the group with the least predicted work so far
(ties to the lowest group index). Groups then take about equal engine and trainer time, which is
what lets one group's generation hide another's training. Round-robin would put, say, all
long-answer math jobs in one group when the task list repeats with period K.
"""

from __future__ import annotations


def balance_groups(work: dict[str, float], k: int) -> list[list[str]]:
    """Split job ids into k non-empty groups with near-equal total work; order inside a group is
    the jobs' original order."""
    ids = list(work)
    if not 1 <= k <= len(ids):
        raise ValueError(f"groups={k} must be between 1 and the number of jobs ({len(ids)})")
    order = sorted(range(len(ids)), key=lambda i: (-work[ids[i]], i))
    loads = [0.0] * k
    members: list[list[int]] = [[] for _ in range(k)]
    for rank, i in enumerate(order):
        # The first k jobs seed the k groups, so no group is empty.
        g = rank if rank < k else min(range(k), key=lambda g: (loads[g], g))
        members[g].append(i)
        loads[g] += work[ids[i]]
    return [[ids[i] for i in sorted(m)] for m in members]
