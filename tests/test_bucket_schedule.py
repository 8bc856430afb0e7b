"""DistributedOptimizer's bucket schedule (optim/schedule.py) by itself: the trials, the
choice and how it is agreed, on step times given here."""
import dataclasses

import pytest

from ringreduce.core.config import Settings
from ringreduce.optim.schedule import (BLOCK, OVERLAP_MARGIN, TIMED, TRIAL_STEPS, TRIALS,
                                       WARM_UP_STEPS, BucketSchedule)


def run_steps(schedule, overlap_ms, inline_ms, steps):
    """`steps` steps, each as long as its schedule's time; returns the schedule of each."""
    now, seen = 0.0, []
    schedule.synchronized(now)          # (the step before: where timing starts)
    for _ in range(steps):
        schedule.step_began()
        seen.append("inline" if schedule.inline else "overlap")
        now += (inline_ms if schedule.inline else overlap_ms) / 1000
        schedule.synchronized(now)
    return seen


def test_auto_tries_both_after_the_warm_up_then_the_first_rank_votes():
    first, other = BucketSchedule("auto", 2, True, False), BucketSchedule("auto", 2, False, False)
    steps = WARM_UP_STEPS + TRIAL_STEPS
    seen = run_steps(first, 100.0, 90.0, steps - 1)   # (the warm-up's first is not timed)
    run_steps(other, 100.0, 90.0, steps - 1)
    assert len(seen) == WARM_UP_STEPS - 1 + TRIAL_STEPS
    assert seen[:WARM_UP_STEPS - 1] == ["overlap"] * (WARM_UP_STEPS - 1)
    assert seen[WARM_UP_STEPS - 1:] == (["overlap"] * BLOCK + ["inline"] * BLOCK) * TRIALS
    vote = first.vote()
    assert vote and other.vote() == 0 and first.vote() == 0    # once, by the first rank
    for schedule in (first, other):
        schedule.agreed(vote)
        assert schedule.chosen == "inline" and schedule.inline
    assert first.measured() == pytest.approx({"overlap": 0.1, "inline": 0.09})


def trials(schedule, step_ms):
    """Drive `schedule` through its warm-up and trials, trial step k taking `step_ms(tried, k)`
    ms (in 1/1024 s: sums and differences stay exact, so a tie is a tie); then the vote."""
    now = 0.0
    schedule.synchronized(now)
    for _ in range(WARM_UP_STEPS - 1):
        schedule.step_began()
        now += 0.125
        schedule.synchronized(now)
    for k in range(TRIAL_STEPS):
        schedule.step_began()
        now += step_ms("inline" if schedule.inline else "overlap", k) / 1024
        schedule.synchronized(now)
    schedule.agreed(schedule.vote())
    return schedule.chosen


def test_the_blocks_last_steps_decide_and_overlap_must_win_by_the_margin():
    """Only the last TIMED steps of each block count (their medians): the first ones, after a
    switch, take junk times here that would otherwise decide. Overlap is taken only where its
    median is quicker than inline's by more than OVERLAP_MARGIN (5%); a tie is inline."""
    for timed, chosen in [(([100, 80, 120], [90, 85, 96]), "inline"),      # 100 > 90
                          (([100, 80, 120], [95, 100, 105]), "inline"),    # a tie
                          (([90, 91, 92], [60, 300, 94]), "inline"),       # 91: 3% < 94
                          (([90, 94, 92], [60, 300, 100]), "overlap")]:    # 92: 8% < 100
        def step_ms(tried, k):
            position, block = k % BLOCK, k // BLOCK // 2
            if position < BLOCK - TIMED:
                return 1 if tried == "overlap" else 1000    # (after a switch: not timed)
            return timed[tried == "inline"][(block * TIMED + position) % 3]

        assert trials(BucketSchedule("auto", 2, True, False), step_ms) == chosen, timed
    assert OVERLAP_MARGIN == 0.05


def test_a_cost_that_builds_up_after_a_switch_is_counted():
    """Overlap quick on the first two steps after a switch (120 ms, the ranks still in step)
    and slower as they drift apart (150), inline 135 throughout (so on a 23.5M MLP, where
    overlap's cost built up over five steps): the second step of pairs would choose overlap,
    11% quicker there; a block's last steps choose inline."""
    def step_ms(tried, k):
        return 135 if tried == "inline" else (120 if k % BLOCK < 2 else 150)

    assert BLOCK - TIMED >= 2
    assert trials(BucketSchedule("auto", 2, True, False), step_ms) == "inline"


def test_fixed_settings_one_rank_and_gpus_do_not_measure():
    for args, chosen, inline in ((("inline", 2, True, False), "inline", True),
                                 (("overlap", 2, True, False), "overlap", False),
                                 (("auto", 1, True, False), "overlap", False),
                                 (("auto", 4, True, True), "overlap", False),
                                 (("inline", 4, True, True), "inline", True)):
        schedule = BucketSchedule(*args)
        assert run_steps(schedule, 100.0, 1.0, 12) == ["inline" if inline else "overlap"] * 12
        assert schedule.vote() == 0 and schedule.chosen == chosen, args
        schedule.agreed(1)      # (a vote it did not ask for changes nothing)
        assert schedule.chosen == chosen


def test_without_a_vote_the_trials_end_in_overlap():
    """A rank deciding (auto) whose first rank does not (its setting fixed): past the trials it
    overlaps, rather than keep the last trial's schedule."""
    schedule = BucketSchedule("auto", 2, False, False)
    seen = run_steps(schedule, 100.0, 1.0, WARM_UP_STEPS + TRIAL_STEPS + 3)
    assert seen[-3:] == ["overlap"] * 3 and "inline" in seen
    assert schedule.chosen is None and schedule.vote() == 0


def test_the_settings_help_says_how_long_auto_measures_and_its_margin():
    """RINGREDUCE_BUCKET_SCHEDULE's help (core.config, below the optimizer: it cannot import
    these constants) names the steps auto measures and overlap's margin: kept in step here."""
    doc = {f.name: f.metadata["doc"] for f in dataclasses.fields(Settings)}["bucket_schedule"]
    assert f"first {WARM_UP_STEPS + TRIAL_STEPS} steps" in doc, doc
    assert f"more than {round(OVERLAP_MARGIN * 100)}% quicker" in doc, doc
