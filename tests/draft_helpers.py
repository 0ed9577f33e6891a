"""Test helpers for the draft policy (batchrun/engine/draft_policy.py)."""

from __future__ import annotations

from batchrun.engine.draft_policy import StepCosts


class FreeRows(StepCosts):
    """A step costs the same whatever its rows: every proposed draft pays. Engine-level tests use it so that they
    check drafts whatever this machine's timings (the policy itself is tested in test_speculative.py)."""

    def observe(self, rows: int, seconds: float) -> None:
        pass

    def curve(self) -> list[tuple[float, float]]:
        return [(1.0, 1.0), (1e6, 1.0)]
