"""DistributedOptimizer's bucket schedule (optim/schedule.py) by itself: the trials, the
choice and how it is agreed, on step times given here."""
import pytest

from ringreduce.optim.schedule import (CHECK_STEPS, KEPT, TRIAL_STEPS, TRIALS, WARM_UP_STEPS,
                                       BucketSchedule)


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
    assert seen[WARM_UP_STEPS - 1:] == ["overlap", "overlap", "inline", "inline"] * TRIALS
    vote = first.vote()
    assert vote and other.vote() == 0 and first.vote() == 0    # once, by the first rank
    for schedule in (first, other):
        schedule.agreed(vote)
        assert schedule.chosen == "inline" and schedule.inline
    assert first.measured() == pytest.approx({"overlap": 0.1, "inline": 0.09})


def test_the_quicker_median_wins_and_a_tie_keeps_overlap():
    """Of the second step of each pair: the first after a switch is not timed (here it would
    make overlap win every time)."""
    # (times in 1/1024 s: the sums and differences stay exact, so a tie is a tie)
    for times, chosen in [(([100, 80, 120, 90], [90, 85, 96, 92]), "inline"),    # 91 < 95
                          (([100, 80, 120, 90], [95, 90, 100, 95]), "overlap"),  # 95 = 95
                          (([90, 91, 92, 93], [60, 300, 94, 95]), "overlap")]:   # 94.5 > 91.5
        schedule = BucketSchedule("auto", 2, True, False)
        now = 0.0
        schedule.synchronized(now)
        for _ in range(WARM_UP_STEPS - 1):
            schedule.step_began()
            now += 0.125
            schedule.synchronized(now)
        overlap, inline = times
        for a, b in zip(overlap, inline):
            for ms in (1, a, 1000, b):      # overlap's pair, then inline's
                schedule.step_began()
                now += ms / 1024
                schedule.synchronized(now)
        schedule.agreed(schedule.vote())
        assert schedule.chosen == chosen, times


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


def train(step_ms, steps):
    """Two ranks' schedules (the first decides) over `steps` steps, as the optimizer drives
    them: each step begins, takes `step_ms(schedule, step)` ms, and its synchronize() carries
    the first rank's vote in the step's agreement to both. Returns the schedule of each step
    (alike on both ranks) and the two."""
    ranks = [BucketSchedule("auto", 2, True, False), BucketSchedule("auto", 2, False, False)]
    now, seen = 0.0, []
    for schedule in ranks:
        schedule.synchronized(now)
    for step in range(steps):
        for schedule in ranks:
            schedule.step_began()
        taken = {"inline" if schedule.inline else "overlap" for schedule in ranks}
        assert len(taken) == 1, f"step {step}: the ranks differ: {taken}"
        seen.append(taken.pop())
        now += step_ms(seen[-1], step) / 1024
        votes = [schedule.vote() for schedule in ranks]
        assert votes[1] == 0
        for schedule in ranks:
            schedule.agreed(votes[0])
            schedule.synchronized(now)
    return seen, ranks


TRIALS_END = WARM_UP_STEPS - 1 + TRIAL_STEPS    # (the warm-up's first step is not timed)


def test_a_choice_confirmed_kept_stays():
    seen, ranks = train(lambda schedule, step: 90 if schedule == "inline" else 100,
                        TRIALS_END + CHECK_STEPS + 5)
    assert seen[TRIALS_END + 1:] == ["inline"] * (CHECK_STEPS + 4)
    first = ranks[0]
    assert first.measured() == pytest.approx({"overlap": 100 / 1024, "inline": 90 / 1024,
                                              "inline kept": 90 / 1024})
    assert first.vote() == 0 and all(r.chosen == "inline" for r in ranks)


def test_trials_that_misjudge_are_corrected_by_the_schedule_kept():
    """Overlap quicker in its trials (130 against 139 ms) but slower kept (149): inline is
    timed kept (128), quicker, and stays on every rank, for good."""
    def step_ms(schedule, step):
        if step < TRIALS_END:
            return 139 if schedule == "inline" else 130
        return 128 if schedule == "inline" else 149

    seen, ranks = train(step_ms, TRIALS_END + CHECK_STEPS + 10)
    assert seen[TRIALS_END + 1] == "overlap"        # the choice, from the trials
    assert seen[-10:] == ["inline"] * 10
    after = seen[TRIALS_END + 1:]
    assert sum(a != b for a, b in zip(after, after[1:])) == 1, after
    assert after.count("overlap") <= 1 + 2 + KEPT, after     # the vote's, settling, kept
    assert ranks[0].measured() == pytest.approx({
        "overlap": 130 / 1024, "inline": 139 / 1024, "overlap kept": 149 / 1024,
        "inline kept": 128 / 1024})
    assert all(r.chosen == "inline" for r in ranks) and ranks[0].vote() == 0


def test_a_switch_slower_kept_goes_back_and_stays():
    """Kept, overlap is slower than inline's trials, but inline kept is slower still: back to
    overlap, which then stays (at most two switches)."""
    def step_ms(schedule, step):
        if step < TRIALS_END:
            return 139 if schedule == "inline" else 130
        return 160 if schedule == "inline" else 149

    seen, ranks = train(step_ms, TRIALS_END + CHECK_STEPS + 30)
    assert seen[-30:] == ["overlap"] * 30
    after = seen[TRIALS_END + 1:]
    assert sum(a != b for a, b in zip(after, after[1:])) == 2, after
    assert ranks[0].measured()["inline kept"] == pytest.approx(160 / 1024)
    assert all(r.chosen == "overlap" for r in ranks)
