"""Where a DistributedOptimizer's buckets are reduced, each as soon as it fills during
backward: on the set's engine thread while backward goes on (`overlap`), or on the training
thread itself, backward pausing for it (`inline`).

Overlap pays where the reduction runs beside backward on a core that would otherwise idle (a
GPU computes while the host moves bytes; a node with more cores than ranks). Where each rank
has one busy core, the engine thread takes its time from backward's, and a rank waits in the
step for buckets its peers reduced late; reducing each bucket inline, its gradients still in
cache and every rank in step, is then quicker. Which holds depends on the model and the
machine, so `auto` (the default, RINGREDUCE_BUCKET_SCHEDULE) measures it: after
`WARM_UP_STEPS`, the steps take the two in turn, `BLOCK` steps at a time, `TRIALS` blocks each
(`TRIAL_STEPS` in all), and only the last `TIMED` steps of each block are timed. A schedule's
cost builds up over several steps after a switch: on a 23.5M-parameter MLP, forced in blocks of
six, overlap took 137-138 ms on a block's first two steps and 152-157 on its last two, inline
126-136 throughout; timed on the second step of pairs, one run's trials put overlap at 133 ms
and inline at 139, chose overlap, and trained at 149 ms a step where inline takes 128. Taking
the two in turn, block by block, lets the machine's slow spells fall on both alike. The time of
a step is from the end of one synchronize() to the end of the next (forward, backward, the
reduction, the wrapped step: what a training loop sees). The set's first rank takes `overlap`
only where its timed steps' median was quicker than inline's by more than `OVERLAP_MARGIN`:
even a block's last steps see part of overlap's cost only (on a ResNet-18-sized CNN, trials of
428 ms against inline's 434 chose overlap, which then took 423 ms a step, where the same
optimizer without bucket views took 381 inline), while inline's is whole from a block's second
step; so where the two are close inline is the safer choice, and where overlap pays (a core
that backward leaves idle) it pays far more than the margin. Every rank learns the choice from
the next step's agreement (step_agreement.py), so all ranks take it from the same step. On GPUs
`auto` is `overlap`: the device computes while the host reduces. The schedule never changes
what is reduced, only on which thread: ranks that differ in it still pair their buckets by
name.
"""
from __future__ import annotations

import statistics
from typing import Optional

WARM_UP_STEPS = 2       # a plan's first steps pay allocations and first touches
BLOCK = 6               # steps each schedule takes in turn
TIMED = 3               # the last steps of a block, timed
TRIALS = 3              # blocks of each schedule
TRIAL_STEPS = 2 * BLOCK * TRIALS
OVERLAP_MARGIN = 0.05   # how much quicker than inline overlap's trials must be to be chosen

AUTO, OVERLAP, INLINE = "auto", "overlap", "inline"
_VOTES = {OVERLAP: 1, INLINE: 2}    # the agreement's byte (0: no vote this step)


def _tried(trial: int) -> str:
    """The schedule of trial step `trial`: `BLOCK` steps each in turn, overlap first."""
    return OVERLAP if trial // BLOCK % 2 == 0 else INLINE


class BucketSchedule:
    """One optimizer's schedule. `setting`: auto, overlap or inline (RINGREDUCE_BUCKET_
    SCHEDULE); `members`: the set's size (of one: nothing to reduce, overlap); `first`:
    whether this rank decides (the set's first); `on_gpu`: whether it trains on a GPU."""

    def __init__(self, setting: str, members: int, first: bool, on_gpu: bool) -> None:
        if members == 1 or (on_gpu and setting == AUTO):
            setting = OVERLAP
        self.inline = setting == INLINE
        self._deciding = setting == AUTO
        self._measures = first and self._deciding
        self._steps = 0
        self._last_end: Optional[float] = None
        self._times: dict[str, list[float]] = {OVERLAP: [], INLINE: []}
        self._vote = 0
        self.chosen: Optional[str] = None if self._deciding else setting

    def _trial_step(self) -> Optional[int]:
        """Which of the trial steps this one is, while deciding; else None."""
        trial = self._steps - WARM_UP_STEPS
        return trial if self._deciding and 0 <= trial < TRIAL_STEPS else None

    def _trial(self) -> Optional[str]:
        """The schedule this step tries, while deciding; else None."""
        trial = self._trial_step()
        return None if trial is None else _tried(trial)

    def step_began(self) -> None:
        """At the step's first gradient (or its synchronize(), if none came). Past the trials,
        until a choice comes (none may, where the first rank does not decide: its setting is
        not auto), `overlap`."""
        if self._deciding:
            self.inline = self._trial() == INLINE

    def synchronized(self, now: float) -> None:
        """At the end of a synchronize() that completed (`now`, time.perf_counter()): one more
        step measured."""
        trial = self._trial_step()
        if trial is not None and trial % BLOCK >= BLOCK - TIMED and self._last_end is not None:
            self._times[_tried(trial)].append(now - self._last_end)    # (a block's last)
            if trial == TRIAL_STEPS - 1 and self._measures:
                self._vote = _VOTES[INLINE if self._takes_inline() else OVERLAP]
        self._last_end = now
        self._steps += 1

    def _takes_inline(self) -> bool:
        """Inline, unless overlap's trials were quicker by more than the margin."""
        inline, overlap = self._times[INLINE], self._times[OVERLAP]
        if not (inline and overlap):
            return False
        return statistics.median(overlap) >= statistics.median(inline) * (1 - OVERLAP_MARGIN)

    def vote(self) -> int:
        """This rank's byte in the step's agreement: its choice, once (the first rank's)."""
        vote, self._vote = self._vote, 0
        return vote

    def agreed(self, vote: int) -> None:
        """The agreement's byte, the same on every rank: a choice made, taken from now on."""
        if vote and self._deciding:
            self.chosen = OVERLAP if vote == _VOTES[OVERLAP] else INLINE
            self.inline = self.chosen == INLINE
            self._deciding = self._measures = False

    def measured(self) -> dict[str, float]:
        """The median step time (seconds) of each schedule's trials so far, for reports."""
        return {k: statistics.median(v) for k, v in self._times.items() if v}
