"""Random interleavings of every KVCacheManager operation (bad token ids and counts among them), check_invariants()
after each step.

CI: a hypothesis state machine (100 examples x up to 100 steps, shrinking on failure) plus a 20k-step plain
random soak. `-m slow` runs the 10^6-step soak; the same run works as a script for the benchmark note:

    .venv/bin/python tests/kv/test_kv_stateful.py --steps 1000000 --seed 0
"""

from __future__ import annotations

import argparse
import time

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from kv_harness import KVHarness, random_manager, soak

RNG = st.randoms(use_true_random=False)


class KVMachine(RuleBasedStateMachine):
    @initialize(rng=RNG)
    def setup(self, rng):
        self.harness = KVHarness(random_manager(rng))

    @invariant()
    def consistent(self):
        self.harness.m.check_invariants()

    def teardown(self):
        if hasattr(self, "harness"):
            self.harness.drain()


def _operation_rule(name: str):
    def run(self, rng):
        getattr(self.harness, name)(rng)

    run.__name__ = name
    return rule(rng=RNG)(run)


for _name in dict.fromkeys(KVHarness.OPS):
    setattr(KVMachine, _name, _operation_rule(_name))

TestKVMachine = KVMachine.TestCase
TestKVMachine.settings = settings(
    max_examples=100, stateful_step_count=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_random_soak_ci():
    outcomes = soak(20_000, seed=1)
    # The walk must actually reach the interesting states, or the soak proves little.
    for outcome in ("allocate:hit", "allocate:none", "append:cow", "append:none", "swap_out:ok", "swap_in:ok",
                    "evict_window:ok", "evictions", "resume_hit_tokens", "export_prefix:hit", "import_prefix:write",
                    "import_prefix:none", "import_prefix:allocate_hit", "bad_input:import_prefix",
                    "bad_token_ids:allocate", "bad_token_ids:append", "bad_token_ids:fill",
                    "bad_token_ids:mark_computed", "bad_token_ids:export_prefix"):
        assert outcomes[outcome] > 0, outcome


@pytest.mark.slow
def test_random_soak_million():
    soak(1_000_000, seed=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    start = time.perf_counter()
    outcomes = soak(args.steps, args.seed)
    seconds = time.perf_counter() - start
    print(f"{args.steps} random steps, seed {args.seed}, check_invariants after each: 0 violations, "
          f"{seconds:.1f} s ({args.steps / seconds:,.0f} steps/s)")
    for outcome, count in sorted(outcomes.items()):
        print(f"  {outcome:28s} {count}")


if __name__ == "__main__":
    main()
