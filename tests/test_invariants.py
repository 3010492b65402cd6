"""Invariants of the chain state machine under random histories, through the real store."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from chainrun.decide import Facts, JobFacts, decide
from chainrun.model import (
    Adopt,
    Finish,
    JobSpec,
    ListedJob,
    Outcome,
    Phase,
    Progress,
    Submit,
)
from chainrun.store import Store

SPEC = JobSpec(
    name="inv",
    command="true",
    workdir="/w",
    total_time=1000,
    walltime=150,
    target_epoch=20,
    max_failures=2,
    checkpoint_dir="/w/c",
    signal="USR1",
    grace=10,
)

# One step of the world: for each live job, what happens to it; and the progress.
job_event = st.sampled_from(["stay", "run", *[o.value for o in Outcome if o is not Outcome.REJECTED]])
step = st.tuples(
    st.lists(job_event, min_size=2, max_size=2), st.integers(0, 3), st.booleans(), st.integers(0, 160)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, min_size=1, max_size=25), st.integers(0, 40))
def test_random_histories_keep_the_invariants(
    steps: list[tuple[list[str], int, bool, int]], cancel_at: int
) -> None:
    """At most one successor ahead, no submit after the end, failures never decrease, budget kept."""
    with tempfile.TemporaryDirectory() as home:
        store = Store(Path(home))
        chain = store.add_chain(SPEC, Progress(), now=0.0)
        now, epoch, jobs, failures = 100.0, 0, 0, 0
        for i, (events, advance, unreadable, elapsed) in enumerate(steps):
            now += 200
            if i == cancel_at:
                store.request_cancel(chain.id, now)
            chain = store.chain(chain.id)
            was_final = chain.state.final
            observations = {}
            for seg, event in zip(sorted(chain.live, key=lambda s: s.n), events):
                if seg.job_id is None or event == "stay":
                    continue
                if event == "run":
                    live = ListedJob(seg.job_id, seg.job_id, Phase.RUNNING)
                else:
                    live = ListedJob(
                        seg.job_id,
                        seg.job_id,
                        Phase.ENDED,
                        outcome=Outcome(event),
                        exit_code=0,
                        started_at=now - min(elapsed, seg.walltime),
                        ended_at=now,
                    )
                observations[seg.job_id] = JobFacts(listed=live)
            epoch += advance
            progress = None if unreadable else Progress(epoch=epoch, saved_at=now)
            actions = decide(chain, Facts(jobs=observations, progress=progress), now)

            if was_final:
                assert actions == []
            finish_at = next((i for i, a in enumerate(actions) if isinstance(a, Finish)), len(actions))
            assert not any(isinstance(a, Submit) for a in actions[finish_at:]), "submit after the end"
            done = []
            for action in actions:
                if isinstance(action, Submit):
                    store.journal_submit(chain.id, action, now)
                    jobs += 1
                    done.append(Adopt(action.n, f"j{jobs}", "submitted"))
                else:
                    done.append(action)
            store.record(chain.id, done, progress, [], now)
            after = store.chain(chain.id)
            assert len(after.live) <= 2, "more than one successor queued ahead"
            assert after.failures >= failures, "failure count decreased"
            failures = after.failures
            assert after.used + sum(s.walltime for s in after.live) <= SPEC.total_time + 1e-6
            assert after.failures <= SPEC.max_failures + 2  # at most the ending segment(s) beyond it
            if after.state.final:
                assert after.live == ()
        store.close()
