"""How the trainer packs a step's rows into micro-batches; pure Python, shared by the real trainer
and the simulator (which charges the padded tokens this plan gives)."""

from __future__ import annotations

from collections import Counter


def step_rows(prompt_tokens: int, n_sequences: int, response_tokens, per_prompt: int = 1,
              share: int = 0) -> list[int]:
    """One job's rows of a train step (prompt + response tokens each) from its rollouts' totals,
    the prompt split evenly: how the simulator and `nodus fit` both see a recorded step. With
    ``share`` > 1 (``trainer.share_prompts``) each run of ``per_prompt`` responses (one prompt's)
    packs up to ``share`` of them into a row: the prompt once, then their responses."""
    each = round(prompt_tokens / max(n_sequences, 1))
    responses = list(response_tokens)
    if share <= 1 or per_prompt <= 1:
        return [each + r for r in responses]
    rows = []
    for p in range(0, len(responses), per_prompt):
        prompt_responses = responses[p:p + per_prompt]
        rows += [each + sum(prompt_responses[c:c + share]) for c in range(0, len(prompt_responses), share)]
    return rows


def plan_microbatches(lengths: list[list[int]], max_tokens: int) -> list[list[tuple[int, int]]]:
    """Split rows (job j, sequence s) of lengths[j][s] tokens into micro-batches of at most
    ``max_tokens`` padded tokens (rows * longest row); a longer row goes alone.

    Longest rows first, so each micro-batch pads to similar lengths; rows of equal length take the
    jobs in turn, so a micro-batch holds about as many rows of every job and the adapter bmm
    needs no padding rows. Each micro-batch is returned job-major: sorted by (j, s).
    """
    order = []
    for j, ls in enumerate(lengths):
        for k, s in enumerate(sorted(range(len(ls)), key=lambda s: -ls[s])):
            order.append((-ls[s], k, j, s))
    order.sort()
    batches: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    longest = 0
    for neg_len, _, j, s in order:
        if current and (len(current) + 1) * max(longest, -neg_len) > max_tokens:
            batches.append(sorted(current))
            current, longest = [], 0
        current.append((j, s))
        longest = max(longest, -neg_len)
    if current:
        batches.append(sorted(current))
    return batches


def packed_pairs_per_microbatch(lengths: list[list[int]], max_tokens: int) -> list[int]:
    """Query-key pairs each micro-batch of a step's packed rows (``trainer.share_prompts``) runs
    through its masked attention: per micro-batch of ``plan_microbatches``, rows x longest row
    squared. The packed row's explicit mask sends it to SDPA's masked kernel, which computes every
    pair of the padded row whatever the mask keeps; a plain row's causal (flash) attention is priced
    inside the per-token term."""
    return [len(mb) * max(lengths[j][s] for j, s in mb) ** 2 for mb in plan_microbatches(lengths, max_tokens)]


def mb_tag(tokens: int) -> str:
    """A micro-batch size in run keys and table labels: 'mb32k' for 32768 tokens, 'mb512' for a
    size that is not a multiple of 1024."""
    return f"mb{tokens // 1024}k" if tokens % 1024 == 0 else f"mb{tokens}"


def microbatch_costs(lengths: list[list[int]], max_tokens: int, layout: str = "padded") -> tuple[list[int], int]:
    """The padded tokens of each micro-batch, and the extra tokens the trainer's multi-adapter
    layout works on beyond them. ``padded``: regrouping, each micro-batch's jobs padded to its
    busiest job's row count (J_mb x most rows of one job x longest row, minus the micro-batch's own
    padded tokens). ``masked``: every row meets every adapter of its micro-batch in the LoRA GEMMs
    (J_mb x r inner columns), so the micro-batch's padded tokens x (J_mb - 1) extra adapter-tokens."""
    if layout not in ("padded", "masked"):
        raise ValueError(f"layout={layout!r}: padded or masked")
    padded, extra = [], 0
    for mb in plan_microbatches(lengths, max_tokens):
        longest = max(lengths[j][s] for j, s in mb)
        counts = Counter(j for j, _ in mb)
        padded.append(len(mb) * longest)
        if layout == "padded":
            extra += (len(counts) * max(counts.values()) - len(mb)) * longest
        else:
            extra += len(mb) * longest * (len(counts) - 1)
    return padded, extra
