"""The store-host failover under a randomized fault schedule (``helpers/nemesis.py`` says what is
done and checked). Two jobs (3 and 4 nodes) run side by side, each through its share of the
schedules (episodes); a job that a two-node episode ended (no majority left: the quorum rule
stops it, as documented) is replaced by a fresh one with a new run id.

Seeded: ``ELASTICSTORE_NEMESIS_SEED`` replays a run (the seed is printed, and named in a
failure); ``ELASTICSTORE_NEMESIS_SCHEDULES`` sets the number of episodes (20 by default, ~3-4
minutes here; e.g. 200 for a long run)."""

from __future__ import annotations

import os
import random
import threading
import time

import pytest
from nemesis import JOIN_TIMEOUT, RECOVER, Job, episode

COUNT = int(os.environ.get("ELASTICSTORE_NEMESIS_SCHEDULES") or 20)
# The run's time budget: ~10-15 s a schedule here, two jobs side by side, and a job that an
# episode ended by the quorum rule costs a fresh job (its agents wait out the join timeout,
# ~50 s apiece here): the budget grows with both. Past it the series stop, and the overrun is
# reported as a missed wall-clock bound, (b), like a slow recovery (a seed with many quorum losses
# under a CI run's load ran past a fixed limit). pytest's timeout is only the net behind it.
BUDGET = 180 + 12 * COUNT
ENDED_JOB_COST = 60.0  # s added to the budget per job ended by the quorum rule
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BUDGET + int(ENDED_JOB_COST) * COUNT + 300)]

START = 120.0  # s: a job's first round trains
END = JOIN_TIMEOUT + 60.0  # s: every node in the group; then every agent exited after the release


def _run_job_series(workdir: str, index: int, nodes: int, seed: str, count: int,
                    report: list[str], failures: list[str], ended: list[str],
                    stop: threading.Event) -> None:
    try:
        _series(workdir, index, nodes, seed, count, report, failures, ended, stop)
    except Exception as exc:  # a thread's error reaches the test as a failure
        failures.append(f"job series {index}: {type(exc).__name__}: {exc}")


def _series(workdir: str, index: int, nodes: int, seed: str, count: int,
            report: list[str], failures: list[str], ended: list[str], stop: threading.Event) -> None:
    rng = random.Random(f"{seed}/{index}")
    series, done = 0, 0
    while done < count and not stop.is_set():
        job = Job(os.path.join(workdir, f"job{index}-{series}"), nodes, index, f"nemesis{index}s{series}")
        series += 1
        ended_early = False
        try:
            job.start_all()
            if job.wait_training(0.0, START, stop) is None:
                if not stop.is_set():
                    failures.append(f"job {job.run_id}: no first round within {START:g}s")
                return
            while done < count and not stop.is_set():
                faults = episode(rng, nodes, job.host())
                done += 1
                majority = job.keeps_majority(faults)
                healed = job.run_episode(faults)
                trained = job.wait_training(healed, RECOVER if majority else JOIN_TIMEOUT + 20,
                                            stop)
                what = "; ".join(f.describe() for f in faults)
                if stop.is_set():  # the run's budget is spent: what ran is still checked
                    failures.extend(f"job {job.run_id}: {v}" for v in job.violations())
                    return
                if trained is None:
                    if majority:
                        said = "; ".join(f"node{n} said: {job.last_lines(f'node{n}', 4)}"
                                         for n in sorted(job.procs))
                        failures.append(f"(b) job {job.run_id} episode {done}: no training within "
                                        f"{RECOVER:g}s of the heal ({what}; {said})")
                    ended_early = True
                    ended.append(job.run_id)
                    report.append(f"{job.run_id} episode {done}: {what} -> job ended")
                    break
                report.append(f"{job.run_id} episode {done}: {what} -> trained again "
                              f"{trained.first - healed:+.1f}s, world {trained.world}")
            codes, outside = job.finish(END)
            if outside and not ended_early:
                said = "; ".join(f"{k} said: {job.last_lines(k)}" for k in outside)
                failures.append(f"(b) job {job.run_id}: not training with the others within "
                                f"{END:g}s of the last episode: {outside} ({said})")
            if not ended_early:
                bad = {k: v for k, v in codes.items() if v != 0}
                if bad:
                    said = "; ".join(f"{k} said: {job.last_lines(k)}"
                                     + (f" (its threads: {job.stacks(k)})" if v is None else "")
                                     for k, v in bad.items())
                    failures.append(f"(b) job {job.run_id}: agents did not finish with 0: {bad} "
                                    f"({said})")
            failures.extend(f"job {job.run_id}: {v}" for v in job.violations())
        finally:
            if failures:
                report.extend(job.log)
            job.cleanup()


def test_nemesis_never_two_groups_and_recovers(tmp_path: object) -> None:
    seed = os.environ.get("ELASTICSTORE_NEMESIS_SEED") or str(random.randrange(1 << 32))
    count = COUNT
    stop = threading.Event()  # set when the test ends early (a timeout): the series clean up
    print(f"nemesis seed {seed}, {count} schedules")
    report: list[str] = []
    failures: list[str] = []
    ended: list[str] = []  # run ids of the jobs an episode ended (each adds to the budget)
    shares = [(0, 3, count - count // 2), (1, 4, count // 2)]
    threads = [threading.Thread(target=_run_job_series, args=(str(tmp_path), index, nodes, seed,
                                                              share, report, failures, ended,
                                                              stop))
               for index, nodes, share in shares if share > 0]
    start = time.monotonic()
    try:
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            budget = BUDGET + ENDED_JOB_COST * len(ended)
            if time.monotonic() - start > budget:
                failures.append(f"(b) the run passed its time budget ({budget:g} s: {COUNT} "
                                f"schedules, {len(ended)} job(s) ended by the quorum rule); the "
                                f"episodes left were not run")
                break
            for t in threads:
                t.join(0.5)
    finally:
        stop.set()
        for t in threads:
            t.join(120)
    print("\n".join(report))
    print(f"nemesis: {count} schedules in {time.monotonic() - start:.0f}s, "
          f"{len(failures)} violation(s)")
    replay = f"nemesis seed {seed} (replay: ELASTICSTORE_NEMESIS_SEED={seed} " \
             f"ELASTICSTORE_NEMESIS_SCHEDULES={count})"
    # (a) never two groups at once, (c) nothing carried goes backwards, and anything
    # unclassified fail the test. (b), the recovery within a wall-clock bound and the exit codes
    # at the end, is reported as an expected failure naming each case and the seed: a machine
    # loaded by other work (a CI run's parallel tests) can miss a wall-clock bound
    # (docs/rendezvous.md, "The nemesis"); a run without any passes.
    timing = [f for f in failures if f.startswith("(b)")]
    assert failures == timing, f"{replay}:\n" + "\n".join(failures)
    if timing:
        pytest.xfail(f"recovery bound or exit codes missed; {replay}:\n" + "\n".join(timing))
