"""Hypothesis stateful tests: random add / step / fork / abort / preempt / evict
sequences, with check_integrity() after every step and the fake executor's KV
simulation checking every read. At the end every block but the null one is free."""

from __future__ import annotations

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from spur.actors.step import SamplingParams

from .helpers import FULL, SLIDING, STATE, assert_all_free, make_engine

PREFIXES = [list(range(100, 112)), list(range(200, 209)), []]


class EngineMachine(RuleBasedStateMachine):
    groups = (FULL,)
    policy = "fcfs"
    min_blocks = 11  # one request of max_model_len=40 must fit

    @initialize(
        extra_blocks=st.integers(0, 24),
        budget=st.integers(4, 40),
        threshold=st.sampled_from([0, 5]),
    )
    def setup(self, extra_blocks, budget, threshold):
        self.core, self.sched, self.fake = make_engine(
            block_size=4,
            num_blocks=self.min_blocks + extra_blocks,
            budget=budget,
            groups=self.groups,
            threshold=threshold,
            policy=self.policy,
            max_model_len=40,
            max_num_seqs=6,
            eos_token_id=3,
            eos_per_mille=60,
        )
        self.next_id = 0
        self.outputs: dict[str, list[int]] = {}

    @rule(
        batch=st.lists(
            st.tuples(
                st.sampled_from(range(len(PREFIXES))),
                st.lists(st.integers(0, 999), min_size=1, max_size=12),
                st.integers(1, 12),
                st.sampled_from([1, 1, 1, 2, 3]),
                st.integers(0, 2),
            ),
            min_size=1,
            max_size=3,
        )
    )
    def add(self, batch):
        for prefix, tail, max_tokens, n, priority in batch:
            rid = f"q{self.next_id}"
            self.next_id += 1
            req = self.sched.make_request(
                rid,
                PREFIXES[prefix] + tail,
                SamplingParams(max_tokens=max_tokens, n=n),
                priority=priority,
                eos_token_id=3,
            )
            self.core.add_request(req)

    @rule(steps=st.integers(1, 6))
    def step(self, steps):
        for _ in range(steps):
            outputs, stats = self.core.step()
            self.sched.check_integrity()
            for o in outputs:
                self.outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
            assert stats.kv_leak_violations == 0
            # Coverage signals (see --hypothesis-show-statistics).
            if stats.num_preemptions:
                event("a step preempted")
            if stats.prefix_hits:
                event("a step had prefix hits")
        if self.fake.num_copies:
            event("copy-on-write happened")
        if self.sched.kv.pool.stats.num_evictions:
            event("evictions happened")

    @precondition(lambda self: self.sched.requests)
    @rule(data=st.data())
    def abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.sched.requests)))
        for o in self.core.abort_requests(rid):
            assert o.finish_reason == "abort"

    @precondition(lambda self: self.sched.running)
    @rule(data=st.data())
    def preempt(self, data):
        victim = data.draw(st.sampled_from(self.sched.running))
        self.sched._preempt(victim)

    @rule()
    def evict(self):
        self.sched.kv.reset_prefix_cache()

    @invariant()
    def integrity(self):
        if hasattr(self, "sched"):
            self.sched.check_integrity()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(2000):
            if not self.core.has_unfinished_requests():
                break
            self.core.step()
            self.sched.check_integrity()
        assert not self.core.has_unfinished_requests()
        assert_all_free(self.sched)


class HybridMachine(EngineMachine):
    groups = (FULL, SLIDING, STATE)
    min_blocks = 23


class PriorityMachine(EngineMachine):
    policy = "priority"


SETTINGS = settings(
    max_examples=60,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestEngine = EngineMachine.TestCase
TestEngine.settings = SETTINGS
TestHybrid = HybridMachine.TestCase
TestHybrid.settings = SETTINGS
TestPriority = PriorityMachine.TestCase
TestPriority.settings = settings(SETTINGS, max_examples=30)
