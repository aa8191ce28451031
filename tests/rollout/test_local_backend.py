"""Generator and trainer in separate processes: the few slow tests of the rollout package."""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml
from rollout_helpers import REWARDS, TINY, tiny_config

from tether.builders import build_prompt_data
from tether.data.cursor import DataCursor
from tether.errors import TetherError
from tether.metrics import read_metrics
from tether.recipes import run_train
from tether.recipes.grpo import build_generator_worker, run_grpo
from tether.rollout.generator_process import TrainerWatch
from tether.rollout.generator_worker import GeneratorCounters
from tether.rollout.local_backend import GeneratorCrashedError, HandoverTransport, ProcessTransport
from tether.rollout.weights import SharedWeights
from tether.training.scoring import SamplingView, completion_logprobs


def write_config(tmp_path, rewards: list[str]) -> str:
    overrides = dict(item.split("=", 1) for item in (*TINY, "data.num_train=64"))
    config: dict = {"recipe": "grpo", "trainer": {"max_steps": 4},
                    "rewards": [{"fn": f"{REWARDS}:{r}"} for r in rewards]}
    for key, value in overrides.items():
        section, _, field = key.partition(".")
        node = config.setdefault(section, {})
        for part in field.split(".")[:-1]:
            node = node.setdefault(part, {})
        node[field.split(".")[-1]] = yaml.safe_load(value)
    path = tmp_path / "grpo.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


@pytest.mark.slow
def test_async_train_from_the_cli_path_stays_within_staleness_and_survives_a_raising_reward(tmp_path):
    path = write_config(tmp_path, ["count_digits", "flaky"])
    # Without the hand-over: a 4-step tiny run ends before the process is up, which it must reach here.
    run_train(path, ["rollout.mode=async", "rollout.max_staleness=2", "rollout.generate_during_boot=false"],
              out=str(tmp_path / "run"))
    metrics = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        assert m["staleness/max"] <= 2
        for key in ("staleness/mean", "staleness/hist", "mismatch/k1", "mismatch/k3",
                    "mismatch/abs_logp_diff", "is/mean", "is/ess", "is/clip_frac", "is/masked_frac"):
            assert key in m, key
        assert sum(m["staleness/hist"].values()) == 12  # one lag per sample
    assert sum(m["reward/errors"] for m in metrics) > 0  # the flaky reward raised; the run went on
    assert (tmp_path / "run" / "final" / "config.json").exists()


@pytest.mark.slow
def test_weights_reach_the_generator_process_on_policy(tmp_path, tiny_policy):
    model, tokenizer = tiny_policy
    config = tiny_config("rollout.mode=async", "rollout.max_staleness=0", "trainer.max_steps=4",
                         "rollout.weight_bucket_mb=0.01", "rollout.generator_threads=1",
                         "trainer.num_threads=1", "rollout.generate_during_boot=false",
                         reward="parity")
    result = run_grpo(config, tmp_path, copy.deepcopy(model), tokenizer)
    assert [m["staleness/max"] for m in result.history] == [0, 0, 0, 0]
    assert all(m["grad_norm"] > 0 for m in result.history)  # the weights changed every step
    # On-policy log-probs agree between trainer and engine only if every version arrived intact.
    assert all(m["mismatch/abs_logp_diff"] < 1e-4 for m in result.history), [
        m["mismatch/abs_logp_diff"] for m in result.history]


def _count_models_then(report: str, make_worker):
    """In the generator process: build the worker, then write how many models the process holds."""
    import gc

    from tether.models.decoder import Decoder

    worker = make_worker()
    gc.collect()
    Path(report).write_text(str(sum(isinstance(obj, Decoder) for obj in gc.get_objects())))
    return worker


@pytest.mark.slow
def test_the_generator_process_holds_one_model_built_from_the_shared_weights(tiny_policy, tmp_path):
    """No copy of the model is pickled to the generator process (that copy stayed alive there for the
    whole run beside the engine's own: two models per process): it builds its engine's model from
    the shared weights' version 0, and samples with the policy's weights."""
    from tether.recipes.grpo import build_process_generator_worker

    model, tokenizer = tiny_policy
    config = tiny_config("rollout.mode=async", "rollout.max_staleness=0", "rollout.generate_during_boot=false")
    policy = copy.deepcopy(model)
    weights = SharedWeights(policy.named_parameters())
    make_worker = functools.partial(build_process_generator_worker, config, policy.config,
                                    next(policy.parameters()).device, tokenizer, weights)
    report = tmp_path / "models"
    transport = ProcessTransport(functools.partial(_count_models_then, str(report), make_worker), weights,
                                 num_threads=1)
    try:
        groups = []
        deadline = time.monotonic() + 120
        while not groups and time.monotonic() < deadline:
            groups = transport.poll(1.0)
        assert report.read_text() == "1"  # the engine's model, nothing else
        completions = groups[0].completions
        logp, _ = completion_logprobs(policy, [c.prompt_ids for c in completions], [c.token_ids for c in completions],
                                      SamplingView())
        for row, c in enumerate(completions):
            assert torch.allclose(logp[row, : c.num_tokens], torch.tensor(c.logprobs), atol=1e-4)
        transport.publish_weights(policy.named_parameters(), 1)  # version 0 was acknowledged: no wait
    finally:
        transport.close()


def _failing_worker():
    raise RuntimeError("engine could not be built")


def _expect_crash(make_worker, model, match: str) -> None:
    """A generator process whose worker factory raises: the trainer's polls report it, with ``match``."""
    transport = ProcessTransport(make_worker, SharedWeights(model.named_parameters()), num_threads=1)
    try:
        with pytest.raises(GeneratorCrashedError, match=match):
            for _ in range(60):
                transport.poll(1.0)
    finally:
        transport.close()


@pytest.mark.slow
def test_a_generator_that_dies_is_reported_with_its_traceback(tiny_policy):
    _expect_crash(_failing_worker, tiny_policy[0], "engine could not be built")


class _StepFailingWorker:
    """Takes weights, then its first engine step fails (as an out-of-memory error would)."""

    def __init__(self) -> None:
        self.counters = GeneratorCounters()
        self.is_idle = False

    def load_weights(self, named_tensors, version: int) -> None:
        for _ in named_tensors:
            pass

    def step(self) -> list:
        raise RuntimeError("CUDA out of memory in the engine step")


@pytest.mark.slow
def test_a_generator_that_dies_while_the_trainer_publishes_is_reported_with_its_error(tiny_policy):
    """The trainer, slower than the generator, finds the crash while it waits for the weights' ack:
    the error names the generator's own exception in one line, not only that the process died."""
    model, _ = tiny_policy
    transport = ProcessTransport(_StepFailingWorker, SharedWeights(model.named_parameters()), num_threads=1)
    try:
        with pytest.raises(GeneratorCrashedError) as info:
            for version in range(1, 200):
                transport.publish_weights(model.named_parameters(), version)
                time.sleep(0.05)
    finally:
        transport.close()
    assert str(info.value) == "the generator process failed: RuntimeError: CUDA out of memory in the engine step"
    assert "Traceback" in info.value.traceback and isinstance(info.value, TetherError)


class _FilteringWorker:
    """Filters one group (dynamic sampling: every reward equal), then has nothing more to do."""

    def __init__(self) -> None:
        self.counters = GeneratorCounters()
        self.is_idle = False

    def step(self) -> list:
        if not self.is_idle:
            self.counters.num_filtered += 1
            self.is_idle = True
        return []


@pytest.mark.slow
def test_a_poll_returns_when_a_group_is_filtered(tiny_policy):
    """The driver counts filtered groups against dynamic sampling's limit after every poll; a poll
    that waited its whole timeout for a group let the generator run far past the limit."""
    transport = ProcessTransport(_FilteringWorker, SharedWeights(tiny_policy[0].named_parameters()), num_threads=1)
    try:
        start = time.monotonic()
        while transport.counters.num_filtered == 0 and time.monotonic() - start < 60:
            assert transport.poll(60.0) == []
        assert transport.counters.num_filtered == 1 and time.monotonic() - start < 30
    finally:
        transport.close()


def test_a_generator_killed_by_a_signal_is_named_in_one_line():
    assert str(GeneratorCrashedError.from_exit(-9)) == (
        "the generator process was killed by SIGKILL (signal 9; out of memory?)")
    assert str(GeneratorCrashedError.from_exit(-11)) == "the generator process was killed by SIGSEGV (signal 11)"
    assert str(GeneratorCrashedError.from_exit(3)) == "the generator process exited with code 3"


def _report_how_a_started_program_takes_ctrl_c(path: str):
    """A worker factory that starts a program, as a reward's sandbox does, records how that program
    handles SIGINT, and fails (the test needs nothing more from the generator)."""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    with open(path, "w") as f:
        f.write(result.stdout.strip())
    raise RuntimeError("reported")


@pytest.mark.slow
def test_programs_the_generator_starts_still_stop_on_ctrl_c(tiny_policy, tmp_path):
    """The generator process leaves Ctrl-C to the trainer by a handler that does nothing, not by
    ignoring SIGINT: an ignored signal stays ignored across exec, and a reward's sandbox that loops
    would outlive the run."""
    report = tmp_path / "sigint.txt"
    _expect_crash(functools.partial(_report_how_a_started_program_takes_ctrl_c, str(report)), tiny_policy[0],
                  "reported")
    assert report.read_text() == "True"  # Python's KeyboardInterrupt handler, not SIG_IGN


class _FloodingWorker:
    """Finishes eight 1 MB "groups", then idles: far more than a pipe (64 KB) holds while nobody polls."""

    def __init__(self) -> None:
        self.counters = GeneratorCounters()
        self.num_left = 8

    @property
    def is_idle(self) -> bool:
        return self.num_left == 0

    def step(self) -> list[bytes]:
        if self.num_left == 0:
            return []
        self.num_left -= 1
        return [b"x" * (1 << 20)]


@pytest.mark.slow
def test_close_stops_a_generator_that_ran_ahead_without_killing_it(tiny_policy):
    """A generator that ran ahead leaves results nobody will read; its process must still exit on
    its own when stopped (it used to hang flushing them into a full pipe until ``close`` timed out
    after 10 s and terminated it, on every async run with S >= 2)."""
    model, _ = tiny_policy
    transport = ProcessTransport(_FloodingWorker, SharedWeights(model.named_parameters()), num_threads=1)
    assert transport.poll(30.0)  # running, and producing
    time.sleep(1.0)  # never polled again: the queue's pipe fills up
    transport.close(timeout_s=10.0)
    assert transport._process.exitcode == 0  # exited by itself, not terminated (-15)


def _after_delay(seconds: float, make_worker):
    """A worker factory that takes at least ``seconds``: a process forked from a warm process
    server can be ready before the trainer's first poll, and this test needs groups from both sides."""
    time.sleep(seconds)
    return make_worker()


@pytest.mark.slow
def test_the_trainer_generates_until_the_process_is_ready_then_hands_the_stream_over(tiny_policy):
    """On-policy (S = 0) across the switch: every group's tokens come from the weights of its
    batch's version, their log-probs equal the trainer's under those weights (so the process got
    the latest weights at the switch), and the prompt stream goes on without a gap or a repeat."""
    model, tokenizer = tiny_policy
    config = tiny_config("rollout.mode=async", "rollout.max_staleness=0", "rollout.max_new_tokens=4")
    policy = copy.deepcopy(model)
    make_worker = functools.partial(build_generator_worker, config, copy.deepcopy(model), tokenizer)
    remote = ProcessTransport(functools.partial(_after_delay, 2.0, make_worker),
                              SharedWeights(policy.named_parameters()), num_threads=1, wait_for_handover=True)
    transport = HandoverTransport(build_generator_worker(config, policy, tokenizer), remote)
    num_groups, version, seen, batch = config.rollout.prompts_per_step, 0, [], []
    try:
        deadline = time.monotonic() + 120
        while sum(remote for _, remote in seen) < 2 * num_groups and time.monotonic() < deadline:
            for group in transport.poll(0.2):
                completions = group.completions
                logp, _ = completion_logprobs(policy, [c.prompt_ids for c in completions],
                                              [c.token_ids for c in completions], SamplingView())
                for row, c in enumerate(completions):
                    assert set(c.versions) == {version}, (c.versions, version)
                    assert torch.allclose(logp[row, : c.num_tokens], torch.tensor(c.logprobs), atol=1e-4)
                seen.append((group, transport.is_handed_over))
                batch.append(group)
            if len(batch) == num_groups:  # "train": new weights, the next version
                with torch.no_grad():
                    for p in policy.parameters():
                        p.add_(0.01 * torch.randn_like(p))
                version += 1
                transport.publish_weights(policy.named_parameters(), version)
                batch = []
    finally:
        transport.close()
    from_process = [remote for _, remote in seen]
    assert from_process[0] is False and from_process[-1] is True, "no handover happened"
    assert from_process == sorted(from_process)  # one switch, never back
    groups = sorted((g for g, _ in seen), key=lambda g: g.uid)
    assert [g.uid for g in groups] == list(range(len(groups)))  # no gap, no repeat
    data = build_prompt_data(config.data, config.seed)
    assert [g.record for g in groups] == DataCursor(data.train, seed=config.seed).take(len(groups))
    assert transport.counters.num_finished == len(groups)  # the counters carried over
    # Each version counted once (the hand-over's re-send is not): the counters arrived with the last
    # groups, generated before the final publish.
    assert transport.counters.num_weight_updates == version - 1


def _slow_worker():
    time.sleep(60)


@pytest.mark.slow
def test_close_does_not_wait_for_a_process_still_starting(tiny_policy):
    model, _ = tiny_policy
    transport = ProcessTransport(_slow_worker, SharedWeights(model.named_parameters()), num_threads=1)
    start = time.monotonic()
    transport.close()
    assert time.monotonic() - start < 5  # terminated at once (waiting it out took 10 s, then SIGTERM)
    assert transport._process.exitcode == -15


PROBE = """
import os
from tether.rollout.process_server import process_context, start_process_server

def report(results):
    import marker  # already imported in the server: the module's code ran there, not here
    results.put((marker.IMPORTED_BY, os.getpid()))

if __name__ == "__main__":
    assert start_process_server(["marker"])
    context = process_context()
    results = context.Queue()
    child = context.Process(target=report, args=(results,))
    child.start()
    imported_by, child_pid = results.get(timeout=120)
    child.join()
    print(imported_by != child_pid and imported_by != os.getpid())
"""


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="no forkserver: generator processes are spawned")
def test_generator_processes_fork_from_a_server_that_imported_their_modules_once(tmp_path):
    """What keeps a generator's start-up to a fork: its modules' code ran once, in the process
    server (a fresh process, so the server is this test's own and its preload list applies)."""
    (tmp_path / "marker.py").write_text("import os\nIMPORTED_BY = os.getpid()\n")
    (tmp_path / "probe.py").write_text(textwrap.dedent(PROBE))
    out = subprocess.run([sys.executable, "probe.py"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_a_generator_sees_its_trainer_gone():
    """A trainer killed by SIGKILL, the OOM killer or a time limit sets no stop event: its generator
    process checks the trainer's pid (every 0.5 s at most) and exits instead of spinning as an orphan."""
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True)
    gone = TrainerWatch(int(finished.stdout))
    assert gone.is_gone()
    alive = TrainerWatch(os.getpid())
    assert not alive.is_gone() and not TrainerWatch(0).is_gone()
    # Killed but not yet collected by its launcher (which may be reading the output the generator
    # holds open until it exits): a zombie is gone too (Linux, where /proc shows it).
    if not Path("/proc/self/stat").is_file():
        return
    zombie = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        zombie.kill()
        stat, deadline = Path(f"/proc/{zombie.pid}/stat"), time.monotonic() + 10
        while "Z" not in stat.read_text().split(")")[-1][:3] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert TrainerWatch(zombie.pid).is_gone()
    finally:
        zombie.wait()


_BLOCKED_GENERATOR = """
import subprocess, sys, threading, time
from tether.rollout.generator_process import exit_when_orphaned
trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.5)"])
threading.Thread(target=exit_when_orphaned, args=(trainer.pid, 0.1), daemon=True).start()
threading.Thread(target=trainer.wait, daemon=True).start()  # collected, as a launcher would
time.sleep(600)  # the main thread stuck in a reward that never returns
"""


def test_a_generator_blocked_in_a_reward_exits_once_its_trainer_is_gone():
    """The main loop checks for its trainer between engine steps only: blocked in a reward, an
    orphaned generator lived on, holding its launcher's output pipe open. Its watch thread exits it."""
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", _BLOCKED_GENERATOR], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1, out.stderr
    assert time.monotonic() - start < 30


_CTRL_C_AT_START = """
import copy, functools, signal, sys, time
sys.path.insert(0, sys.argv[1])
from rollout_helpers import tiny_config
from tether.builders import build_model_and_tokenizer
from tether.recipes.grpo import build_generator_worker, start_generator_process_server
from tether.rollout.local_backend import ProcessTransport
from tether.rollout.weights import SharedWeights

config = tiny_config("rollout.mode=async", "rollout.max_staleness=1")
model, tokenizer = build_model_and_tokenizer(config.model, None, 0)
start_generator_process_server(config, tokenizer)  # as tether train does: the server imports meanwhile
signal.signal(signal.SIGALRM, lambda *_: signal.raise_signal(signal.SIGINT))
signal.setitimer(signal.ITIMER_REAL, 0.3)  # Ctrl-C while the transport waits for the server
try:
    ProcessTransport(functools.partial(build_generator_worker, config, copy.deepcopy(model), tokenizer),
                     SharedWeights(model.named_parameters()), num_threads=1, wait_for_handover=True)
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


@pytest.mark.slow
def test_ctrl_c_while_the_generator_process_starts_leaves_no_traceback(tmp_path):
    """Ctrl-C in an async run's first seconds, while the process server imports: the trainer stops
    with KeyboardInterrupt after the child is forked, and nothing prints a traceback (a child the
    server forked after the trainer had gone printed one)."""
    result = subprocess.run([sys.executable, "-c", _CTRL_C_AT_START, str(Path(__file__).parent)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=300)
    assert result.stdout.strip() == "interrupted" and "Traceback" not in result.stderr, result.stderr
