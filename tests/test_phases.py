"""The phase clock (``plait.plugins.fault.phases``) without processes: only the steps it is told
to time are timed, and a compiled model's phases are measured at each step, not traced once.

The GPU crash this guards against (issue 32: under ``strategy.compile=true`` the forward hooks
ran inside the compiled graph, so their CUDA events were made but never recorded) has the same
cause on the CPU: a clock read inside traced code. A GPU test runs the CUDA clock
(``tests/test_cuda.py`` marks such tests; this one runs anywhere)."""

import statistics

import pytest
import torch

from plait.plugins.fault.phases import PhaseClock, progress
from plait.types import StepOutput


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(64, 256)
        self.b = torch.nn.Linear(256, 64)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def engine_step(forward, optimizer):
    def train_step(micro_batches, lr):
        for x in micro_batches:
            forward(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        return StepOutput(loss=0.0, grad_norm=0.0)

    return train_step


def steps(clock, step, n, micro_batches):
    return [clock.train_step(step, micro_batches, lr=0.1) for _ in range(n)]


@pytest.fixture(autouse=True)
def fresh_progress():
    progress.step = 0
    yield
    progress.step = 0


def test_only_the_steps_it_is_told_to_time_carry_phases():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = PhaseClock(model, optimizer, torch.device("cpu"), timed=lambda s: s % 3 == 0)
    outs = steps(clock, engine_step(model, optimizer), 6, [torch.randn(8, 64)] * 2)
    assert [bool(o.timings) for o in outs] == [False, False, True, False, False, True]
    for out in (outs[2], outs[5]):
        assert set(out.timings) == {
            "forward_s",
            "backward_s",
            "optimizer_s",
            "comm_wait_s",
            "compute_s",
        }
        assert out.timings["compute_s"] > 0
    assert progress.step == 6 and progress.grads == 4  # marks kept on every step


def test_a_compiled_model_is_timed_at_every_timed_step():
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = PhaseClock(model, optimizer, torch.device("cpu"))
    step = engine_step(torch.compile(model, backend="aot_eager", dynamic=False), optimizer)
    small, large = [torch.randn(8, 64)], [torch.randn(4096, 64)]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # all the work on the thread whose CPU clock is read
    try:
        steps(clock, step, 2, small) + steps(clock, step, 2, large)  # compiled for both shapes
        small, large = steps(clock, step, 3, small), steps(clock, step, 3, large)
    finally:
        torch.set_num_threads(threads)
    # every forward was seen (the hooks ran, once per micro-batch) and its work counted: a
    # step on 512x the rows costs more CPU time than the small one (~15x), by the medians of the
    # 3 steps: one small step at 3.4 ms of CPU against ~0.8 (once, in a suite worker beside
    # another) must not decide it
    assert clock.forwards == 1
    assert all(o.timings["forward_s"] > 0 and o.timings["compute_s"] > 0 for o in small + large)
    assert statistics.median(o.timings["compute_s"] for o in large) > 5 * statistics.median(
        o.timings["compute_s"] for o in small
    )


def test_a_schedule_that_calls_the_stages_parts_times_only_the_optimizer_and_the_rest():
    """Under a pipeline the schedule calls the stages' parts, not the model: its forward hooks
    never run, its parameters' gradient hooks do. The backward then has no start to be measured
    from (it read ``perf_counter()`` since boot, ~28,000 s, on every logged pp2 step), so it is
    not measured: forward and backward 0, the whole step outside the optimizer in comm_wait_s."""
    torch.manual_seed(0)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = PhaseClock(model, optimizer, torch.device("cpu"))
    parts = engine_step(lambda x: model.b(torch.relu(model.a(x))), optimizer)
    progress.grads = 0
    [out] = steps(clock, parts, 1, [torch.randn(8, 64)] * 2)
    assert out.timings["forward_s"] == 0 and out.timings["backward_s"] == 0
    assert 0 < out.timings["comm_wait_s"] < 60 and "compute_s" not in out.timings
    assert progress.grads == 8  # the watchdog still counts gradients (no forward resets it)


def test_a_replica_group_that_recovered_from_a_peer_times_the_logged_steps_the_others_do():
    """fault=torchft: a restarted group receives a peer's state (``plait_sync_replicas``) instead
    of loading a checkpoint; its step timing continues at the peer's step, so it takes part in
    the straggler detector's exchange after the same logged steps as the others (a group that
    counted from 0 again skipped it, and both sides stalled until the 60 s timeouts)."""
    from plait import hookimpl
    from plait.plugin_manager import keep_selected, make_plugin_manager
    from plait.testing import compose
    from plait.types import TrainState

    class Peer:
        @hookimpl
        def plait_sync_replicas(self, state):
            return TrainState(step=27) if state is None else None

    cfg = compose(["fault=torchft", "train.log_every=10"])
    pm = keep_selected(make_plugin_manager(cfg), cfg)
    pm.register(Peer())
    progress.step = 0
    received = pm.hook.plait_sync_replicas(cfg=cfg, engine=None, state=None, topology=None)
    assert received.step == 27 and progress.step == 27
