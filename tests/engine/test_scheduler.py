"""Scheduler unit tests on the real KV manager with a fake model: each step marks the chunks computed and gives
every sampling sequence one more token, until a sequence reaches its target length."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ioattn.engine.scheduler import Scheduler, SchedulerConfig
from ioattn.engine.sequence import Sequence, SequenceStatus
from ioattn.kv import KVCacheManager


class FakeEngine:
    def __init__(self, num_blocks=16, block_size=4, num_cpu_blocks=0, **config):
        config.setdefault("max_model_len", 64)
        config.setdefault("max_num_seqs", 4)
        self.kv = KVCacheManager(num_blocks, block_size, num_cpu_blocks=num_cpu_blocks, watermark=0.0)
        self.scheduler = Scheduler(SchedulerConfig(**config), self.kv)
        self.targets = {}
        self.ids = itertools.count()
        self.clock = itertools.count()
        self.finished = []

    def add(self, prompt_len, output_len, priority=0, first_token=0):
        seq = Sequence(next(self.ids), "r", list(range(first_token, first_token + prompt_len)), prompt_len,
                       float(next(self.clock)), priority)
        self.targets[seq.seq_id] = prompt_len + output_len
        self.scheduler.add(seq)
        return seq

    def step(self):
        out = self.scheduler.schedule()
        for chunk in out.chunks:
            self.scheduler.advance(chunk)
            self.scheduler.commit(chunk)
            if chunk.samples:
                seq = chunk.seq
                seq.token_ids.append(1000 + seq.num_tokens)
                if seq.num_tokens >= self.targets[seq.seq_id]:
                    self.scheduler.finish(seq)
                    self.finished.append(seq)
        self.kv.check_invariants()
        return out

    def run(self, max_steps=500):
        outs = []
        while self.scheduler.has_unfinished():
            outs.append(self.step())
            assert len(outs) < max_steps, "no progress"
        return outs


def test_budget_decodes_first_then_chunked_prefill():
    engine = FakeEngine(num_blocks=32, max_num_batched_tokens=8, max_num_seqs=4)
    first = engine.add(prompt_len=5, output_len=4)
    out = engine.step()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(first, 0, 5)]
    second = engine.add(prompt_len=20, output_len=2, first_token=100)
    out = engine.step()
    # The decode goes first (1 token), the new prompt fills the remaining 7.
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(first, 5, 1), (second, 0, 7)]
    out = engine.step()
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(first, 6, 1), (second, 7, 7)]
    assert all(o.num_batched_tokens <= 8 for o in engine.run())
    assert engine.kv.stats().blocks_used == 0


def test_finished_slot_is_refilled_on_the_next_step():
    """Iteration-level batching: a waiting request takes a finished sequence's place at once."""
    engine = FakeEngine(num_blocks=64, max_num_batched_tokens=64, max_num_seqs=2)
    short = engine.add(prompt_len=3, output_len=2)
    engine.add(prompt_len=3, output_len=9, first_token=10)
    waiting = engine.add(prompt_len=3, output_len=2, first_token=20)
    engine.step()
    engine.step()
    assert short.is_finished and waiting.status is SequenceStatus.WAITING
    out = engine.step()
    assert waiting in [c.seq for c in out.chunks]


def test_max_num_seqs_caps_running():
    engine = FakeEngine(num_blocks=64, max_num_batched_tokens=64, max_num_seqs=2)
    for _ in range(5):
        engine.add(prompt_len=3, output_len=3)
    while engine.scheduler.has_unfinished():
        engine.step()
        assert len(engine.scheduler.running) <= 2
    assert len(engine.finished) == 5


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_takes_latest_arrival(mode):
    engine = FakeEngine(num_blocks=6, num_cpu_blocks=32, max_num_batched_tokens=16, max_num_seqs=4,
                        preemption_mode=mode)
    early = engine.add(prompt_len=8, output_len=12)
    late = engine.add(prompt_len=8, output_len=12)
    preempted = []
    for _ in range(200):
        if not engine.scheduler.has_unfinished():
            break
        preempted += engine.step().preempted
    assert preempted and preempted[0] is late
    assert early not in preempted
    assert engine.finished[0] is early and set(engine.finished) == {early, late}
    expected = SequenceStatus.FINISHED
    assert early.status is late.status is expected
    stats = engine.kv.stats()
    assert stats.blocks_used == 0 and stats.cpu_blocks_used == 0
    if mode == "swap":
        assert stats.swap_out_blocks > 0 and stats.swap_in_blocks == stats.swap_out_blocks


def test_priority_policy_preempts_lowest_priority():
    engine = FakeEngine(num_blocks=6, max_num_batched_tokens=16, max_num_seqs=4, policy="priority")
    important_late = engine.add(prompt_len=8, output_len=12, priority=0)
    unimportant = engine.add(prompt_len=8, output_len=12, priority=5)
    # Lower value is served first, whatever the arrival order.
    assert engine.scheduler.waiting == [important_late, unimportant]
    preempted = []
    while engine.scheduler.has_unfinished():
        preempted += engine.step().preempted
    assert preempted and all(seq is unimportant for seq in preempted)


@pytest.mark.parametrize("budget", [32, 4])
def test_no_preemption_storm_resumed_sequence_makes_progress(budget):
    """A preempted sequence produces a new token after it comes back before it can be preempted again (with a
    small budget its recompute spans several chunked steps, during which it is spared)."""
    engine = FakeEngine(num_blocks=8, max_num_batched_tokens=budget, max_num_seqs=4)
    for i in range(4):
        engine.add(prompt_len=6, output_len=14, first_token=10 * i)
    tokens_at_preemption = {}
    while engine.scheduler.has_unfinished():
        for seq in engine.step().preempted:
            assert seq.num_tokens > tokens_at_preemption.get(seq.seq_id, -1), f"seq {seq.seq_id} preempted twice"
            tokens_at_preemption[seq.seq_id] = seq.num_tokens
    assert engine.scheduler.num_preemptions > 1
    assert engine.kv.stats().blocks_used == 0


def test_freshly_resumed_sequence_is_spared():
    engine = FakeEngine(num_blocks=4, max_num_batched_tokens=16)
    early, middle, resumed = (engine.add(prompt_len=4, output_len=8, first_token=10 * i) for i in range(3))
    engine.step()  # three prompts of one block each; each samples a token that needs a second block
    resumed.resumed_without_progress = True  # as if it had just come back from a preemption
    out = engine.step()
    # One block is free: the early decode takes it; the next-latest unprotected sequence goes, not `resumed`.
    assert out.preempted == [middle]
    assert [c.seq for c in out.chunks] == [early, resumed]


def test_prefix_cache_hit_skips_prefill():
    engine = FakeEngine(num_blocks=32, max_num_batched_tokens=64, max_num_seqs=4)
    engine.add(prompt_len=13, output_len=1)
    engine.run()
    again = engine.add(prompt_len=13, output_len=1)
    out = engine.step()
    # 3 full blocks of 4 were cached; the prompt's last token is always computed.
    assert [(c.seq, c.start, c.num_tokens) for c in out.chunks] == [(again, 12, 1)]


def test_static_mode_waits_for_the_whole_batch():
    # max_model_len 16 = 4 blocks reserved per sequence: 12 blocks admit 3 at a time.
    engine = FakeEngine(num_blocks=12, max_num_batched_tokens=64, max_num_seqs=8, max_model_len=16, mode="static")
    seqs = [engine.add(prompt_len=4, output_len=n, first_token=10 * i) for i, n in enumerate([2, 8, 3, 2, 2])]
    first_batch = seqs[:3]
    engine.step()
    assert engine.scheduler.running == first_batch
    while any(not s.is_finished for s in first_batch):
        engine.step()
        # Finished slots are not refilled until the whole batch is done.
        assert all(s.status is SequenceStatus.WAITING for s in seqs[3:])
    engine.run()
    assert engine.scheduler.num_preemptions == 0 and len(engine.finished) == 5


def test_finish_frees_waiting_running_and_swapped():
    engine = FakeEngine(num_blocks=6, num_cpu_blocks=16, max_num_batched_tokens=16, preemption_mode="swap")
    a = engine.add(prompt_len=8, output_len=30)
    b = engine.add(prompt_len=8, output_len=30)
    c = engine.add(prompt_len=8, output_len=30)
    while b.status is not SequenceStatus.SWAPPED:
        engine.step()
    for seq in (a, b, c):
        engine.scheduler.finish(seq)
    stats = engine.kv.stats()
    assert stats.blocks_used == 0 and stats.cpu_blocks_used == 0 and not engine.scheduler.has_unfinished()
    engine.kv.check_invariants()


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(max_model_len=8, preemption_mode="drop")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_model_len=8, max_num_seqs=8, max_num_batched_tokens=4)
    with pytest.raises(ValueError, match="max_model_len"):
        SchedulerConfig(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, enable_chunked_prefill=False)


@settings(max_examples=25, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(1, 20), st.integers(1, 12), st.integers(0, 2)), min_size=1, max_size=8),
    num_blocks=st.integers(6, 24),
    budget=st.integers(8, 24),
    mode=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "priority"]),
)
def test_random_workloads_finish_and_free_everything(requests, num_blocks, budget, mode, policy):
    engine = FakeEngine(num_blocks=num_blocks, num_cpu_blocks=64, max_num_batched_tokens=budget, max_num_seqs=8,
                        max_model_len=24, preemption_mode=mode, policy=policy)
    seqs = [engine.add(p, min(o, 24 - p) or 1, priority=pr, first_token=10 * i)
            for i, (p, o, pr) in enumerate(requests)]
    for out in engine.run(max_steps=2000):
        assert out.num_batched_tokens <= budget
        assert len({c.seq.seq_id for c in out.chunks}) == len(out.chunks)
    assert all(s.is_finished and s.num_tokens == engine.targets[s.seq_id] for s in seqs)
    stats = engine.kv.stats()
    assert stats.blocks_used == 0 and stats.cpu_blocks_used == 0
