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
# ~10-15 s a schedule here, two jobs side by side: the limit grows with the count.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(180 + 12 * COUNT)]

START = 120.0  # s: a job's first round trains
END = JOIN_TIMEOUT + 60.0  # s: every agent left has exited after the release


def _run_job_series(workdir: str, index: int, nodes: int, seed: str, count: int,
                    report: list[str], failures: list[str], stop: threading.Event) -> None:
    try:
        _series(workdir, index, nodes, seed, count, report, failures, stop)
    except Exception as exc:  # a thread's error reaches the test as a failure
        failures.append(f"job series {index}: {type(exc).__name__}: {exc}")


def _series(workdir: str, index: int, nodes: int, seed: str, count: int,
            report: list[str], failures: list[str], stop: threading.Event) -> None:
    rng = random.Random(f"{seed}/{index}")
    series, done = 0, 0
    while done < count and not stop.is_set():
        job = Job(os.path.join(workdir, f"job{index}-{series}"), nodes, index, f"nemesis{index}s{series}")
        series += 1
        ended_early = False
        try:
            job.start_all()
            if job.wait_training(0.0, START) is None:
                failures.append(f"job {job.run_id}: no first round within {START:g}s")
                return
            while done < count and not stop.is_set():
                faults = episode(rng, nodes, job.host())
                done += 1
                majority = job.keeps_majority(faults)
                healed = job.run_episode(faults)
                trained = job.wait_training(healed, RECOVER if majority else JOIN_TIMEOUT + 20)
                what = "; ".join(f.describe() for f in faults)
                if trained is None:
                    if majority:
                        failures.append(f"(b) job {job.run_id} episode {done}: no training within "
                                        f"{RECOVER:g}s of the heal ({what})")
                    ended_early = True
                    report.append(f"{job.run_id} episode {done}: {what} -> job ended")
                    break
                report.append(f"{job.run_id} episode {done}: {what} -> trained again "
                              f"{trained.first - healed:+.1f}s, world {trained.world}")
            codes = job.finish(END)
            if not ended_early:
                bad = {k: v for k, v in codes.items() if v != 0}
                if bad:
                    said = "; ".join(f"{k} said: {job.last_lines(k)}" for k in bad)
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
    shares = [(0, 3, count - count // 2), (1, 4, count // 2)]
    threads = [threading.Thread(target=_run_job_series, args=(str(tmp_path), index, nodes, seed,
                                                              share, report, failures, stop))
               for index, nodes, share in shares if share > 0]
    start = time.monotonic()
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
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
