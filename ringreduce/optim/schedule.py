"""Where a DistributedOptimizer's buckets are reduced, each as soon as it fills during
backward: on the set's engine thread while backward goes on (`overlap`), or on the training
thread itself, backward pausing for it (`inline`).

Overlap pays where the reduction runs beside backward on a core that would otherwise idle (a
GPU computes while the host moves bytes; a node with more cores than ranks). Where each rank
has one busy core, the engine thread takes its time from backward's, and a rank waits in the
step for buckets its peers reduced late; reducing each bucket inline, its gradients still in
cache and every rank in step, is then quicker. Which holds depends on the model and the
machine, so `auto` (the default, RINGREDUCE_BUCKET_SCHEDULE) measures it: after
`WARM_UP_STEPS`, the steps take the two in turn, two steps at a time, `TRIALS` times each
(`TRIAL_STEPS` in all), and only the second step of each pair is timed: the first step after
a switch is not what the schedule costs when kept (an overlap step right after an inline one
measured 6-8 ms, 5%, quicker than one after overlap on a 23.5M-parameter MLP, which made one
run in four choose overlap there and then train 10% slower). The time of a step is from the
end of one synchronize() to the end of the next (forward, backward, the reduction, the
wrapped step: what a training loop sees). The set's first rank takes the one whose steps'
median was quicker (`overlap` on a tie: what DDP and Horovod users expect; where the two are
close, either costs little), and every rank learns the choice from the next step's
agreement (step_agreement.py), so all ranks take it from the same step.

The trials only estimate what a schedule costs when kept: a cost that builds up over more
than two steps (ranks drifting out of phase under overlap) escapes them, and on a noisy
machine four steps each can mislead (a 23.5M-parameter MLP's trials once measured overlap at
133 ms a step and inline at 139; kept, overlap took 149 and inline 128). So the first rank
then times the choice kept, `KEPT` steps after the two that follow a switch: if their median
is slower than the other schedule's trials, it switches to the other and times that kept too,
and the one whose kept steps were quicker stays, for good (at most two switches, each agreed
as the first choice is). On GPUs `auto` is `overlap`: the device computes while the host
reduces. The schedule never changes what is reduced, only on which thread: ranks that differ
in it still pair their buckets by name.
"""
from __future__ import annotations

import statistics
from typing import Optional

WARM_UP_STEPS = 2       # a plan's first steps pay allocations and first touches
TRIALS = 4              # steps measured under each schedule
TRIAL_STEPS = 4 * TRIALS    # each measured step follows one under the same schedule
KEPT = 4                # steps timed under a schedule kept, after the choice or a switch
SETTLING = 2            # steps not timed after a vote: its own, and the first taking it
CHECK_STEPS = 2 * (SETTLING + KEPT) + 1     # the most steps from the trials to the last vote

AUTO, OVERLAP, INLINE = "auto", "overlap", "inline"
_VOTES = {OVERLAP: 1, INLINE: 2}    # the agreement's byte (0: no vote this step)


def _tried(trial: int) -> str:
    """The schedule of trial step `trial`: two steps each in turn, overlap first."""
    return OVERLAP if trial // 2 % 2 == 0 else INLINE


class BucketSchedule:
    """One optimizer's schedule. `setting`: auto, overlap or inline (RINGREDUCE_BUCKET_
    SCHEDULE); `members`: the set's size (of one: nothing to reduce, overlap); `first`:
    whether this rank decides (the set's first); `on_gpu`: whether it trains on a GPU."""

    def __init__(self, setting: str, members: int, first: bool, on_gpu: bool) -> None:
        if members == 1 or (on_gpu and setting == AUTO):
            setting = OVERLAP
        self.inline = setting == INLINE
        self._auto = setting == AUTO        # a vote may come (the first rank's choice)
        self._deciding = self._auto         # trials, until the first vote is agreed
        self._measures = first and self._auto
        self._steps = 0
        self._last_end: Optional[float] = None
        self._times: dict[str, list[float]] = {OVERLAP: [], INLINE: []}
        self._kept: dict[str, float] = {}   # a kept schedule's median step, where timed
        self._keeping: Optional[list[float]] = None     # the kept steps timed so far
        self._settling = 0
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
        took = None if self._last_end is None else now - self._last_end
        self._last_end = now
        trial = self._trial_step()
        self._steps += 1
        if trial is not None and trial % 2 == 1 and took is not None:
            self._times[_tried(trial)].append(took)    # (a pair's second)
            if trial == TRIAL_STEPS - 1 and self._measures:
                self._vote = _VOTES[INLINE if self._inline_quicker() else OVERLAP]
        elif self._keeping is not None:
            if self._settling:
                self._settling -= 1
            elif took is not None:
                self._keeping.append(took)
                if len(self._keeping) == KEPT:
                    self._kept_timed(statistics.median(self._keeping))

    def _inline_quicker(self) -> bool:
        inline, overlap = self._times[INLINE], self._times[OVERLAP]
        return bool(inline and overlap) and statistics.median(inline) < statistics.median(
            overlap)

    def _kept_timed(self, median: float) -> None:
        """The first rank has timed the schedule taken, kept: stay, or vote to switch."""
        taken = INLINE if self.inline else OVERLAP
        other = OVERLAP if self.inline else INLINE
        self._kept[taken], self._keeping = median, None
        if other in self._kept:         # both timed kept: the quicker stays (a tie: this one)
            if self._kept[other] < median:
                self._vote = _VOTES[other]
            self._measures = False
        elif self._times[other] and median > statistics.median(self._times[other]):
            self._vote = _VOTES[other]  # slower kept than the other's trials: try it kept
        else:
            self._measures = False

    def vote(self) -> int:
        """This rank's byte in the step's agreement: its choice, or a switch (the first
        rank's), once each."""
        vote, self._vote = self._vote, 0
        return vote

    def agreed(self, vote: int) -> None:
        """The agreement's byte, the same on every rank: a choice or a switch, taken from now
        on (the first rank then times it kept, where it still checks)."""
        if vote and self._auto:
            self.chosen = OVERLAP if vote == _VOTES[OVERLAP] else INLINE
            self.inline = self.chosen == INLINE
            self._deciding = False
            if self._measures:
                self._keeping, self._settling = [], SETTLING

    def measured(self) -> dict[str, float]:
        """The median step time (seconds) of each schedule's trials so far, and of each
        schedule timed kept ('overlap kept', 'inline kept'), for reports."""
        trials = {k: statistics.median(v) for k, v in self._times.items() if v}
        return {**trials, **{f"{k} kept": v for k, v in self._kept.items()}}
