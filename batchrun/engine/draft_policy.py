"""Which drafts a step checks: the likeliest kept first, as many as make its expected tokens per second largest,
from a step's seconds by its rows (StepCosts) and each sequence's KeepRate. Why: docs/performance.md."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

# Step sizes whose times are learned: each observed step updates the nearest point at or below its rows.
GRID = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096,
        6144, 8192, 12288, 16384)
SMOOTHING = 0.25  # the weight of a new step in its point's running means (the machine's speed drifts)
PRIOR_KEEP_RATE = 0.5  # the keep rate before any draft of the job was checked
PRIOR_WEIGHT = 4.0  # the trials a guess counts as


@dataclass
class StepCosts:
    """Seconds a step takes by its rows: running means of (rows, seconds) per GRID point, interpolated."""

    rows: list[float] = field(default_factory=lambda: [0.0] * len(GRID))
    seconds: list[float] = field(default_factory=lambda: [0.0] * len(GRID))
    seen: list[bool] = field(default_factory=lambda: [False] * len(GRID))

    def observe(self, rows: int, seconds: float) -> None:
        if rows <= 0 or seconds <= 0:
            return
        i = max(bisect.bisect_right(GRID, rows) - 1, 0)
        if not self.seen[i]:
            self.rows[i], self.seconds[i], self.seen[i] = float(rows), seconds, True
            return
        self.rows[i] += SMOOTHING * (rows - self.rows[i])
        self.seconds[i] += SMOOTHING * (seconds - self.seconds[i])

    def curve(self) -> list[tuple[float, float]]:
        """The learned (rows, seconds) by rows, less any point slower than one with more rows (noise)."""
        points = [(r, s) for r, s, ok in zip(self.rows, self.seconds, self.seen) if ok]
        kept: list[tuple[float, float]] = []
        for r, s in points:
            while kept and kept[-1][1] > s:
                kept.pop()
            kept.append((r, s))
        return kept

    @staticmethod
    def at(curve: list[tuple[float, float]], rows: float) -> float:
        """Seconds at `rows` on a curve of >= 2 points: linear, the last slope past it, the first point below it."""
        if rows <= curve[0][0]:
            return curve[0][1]
        i = min(bisect.bisect_left(curve, (rows, -1.0)), len(curve) - 1)
        (r0, s0), (r1, s1) = curve[i - 1], curve[i]
        return s0 + (s1 - s0) * (rows - r0) / (r1 - r0)


@dataclass
class KeepRate:
    """Kept drafts over checked positions (up to the first miss), smoothed by PRIOR_WEIGHT trials toward the prior
    (every sequence's record, so a new sequence starts from the job's) or PRIOR_KEEP_RATE without one."""

    kept: int = 0
    trials: int = 0
    prior: KeepRate | None = None

    def record(self, num_drafted: int, num_kept: int) -> None:
        self.kept += num_kept
        self.trials += num_kept + (num_kept < num_drafted)
        if self.prior is not None:
            self.prior.record(num_drafted, num_kept)

    @property
    def rate(self) -> float:
        guess = PRIOR_KEEP_RATE if self.prior is None else self.prior.rate
        return (self.kept + guess * PRIOR_WEIGHT) / (self.trials + PRIOR_WEIGHT)


def choose_drafts(proposals: list[tuple[int, list[int], float]], rows: int, spare: int,
                  costs: StepCosts) -> dict[int, list[int]]:
    """seq_id -> the prefix of its drafts to check, at most `spare` in all, that makes (rows + expected kept drafts)
    / seconds(rows + drafts) largest (rows: the step's without drafts); none before the costs have two points."""
    curve = costs.curve()
    if len(curve) < 2 or rows <= 0:
        return {}
    chances: list[tuple[float, int, int]] = []  # (chance the draft is kept, its position, seq index)
    for s, (_, drafts, rate) in enumerate(proposals):
        chance = 1.0
        for j in range(len(drafts)):
            chance *= rate
            chances.append((chance, j, s))
    chances.sort(key=lambda c: -c[0])  # stable: a sequence's drafts stay in order (their chances fall with j)
    chances = chances[:spare]
    base = StepCosts.at(curve, rows)
    best, best_n, expected = rows / base, 0, 0.0
    for n, (chance, _, _) in enumerate(chances, start=1):
        expected += chance
        worth = (rows + expected) / StepCosts.at(curve, rows + n)
        if worth > best:
            best, best_n = worth, n
    plan: dict[int, list[int]] = {}
    for _, j, s in chances[:best_n]:
        seq_id, drafts, _ = proposals[s]
        plan[seq_id] = drafts[: j + 1] if j + 1 > len(plan.get(seq_id, ())) else plan[seq_id]
    return plan
