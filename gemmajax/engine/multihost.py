"""Multi-host serving: host 0 schedules (and serves HTTP); every host runs the same device steps.

A mesh that spans processes runs a program only when every process enters it, in the same order, with the same
inputs. Host 0 owns the scheduler, so its runner is wrapped in a `LeaderRunner` that broadcasts each step first:
a fixed-size header (the step's shapes and variant), then the StepInputs arrays. The other hosts sit in
`follow(runner)`: receive a step, run it on their shards, repeat until the leader sends STOP. Outputs are
replicated (runner.compiled_step), and the leader hands the engine its own copy (`addressable_data(0)`, a
single-device array), so host-side work after the step (sampling, reading tokens) never needs the other hosts.

The offline LLM needs none of this: every process builds the same LLM and makes the same generate calls, and the
scheduler is deterministic, so all processes already run the same steps (tests/test_parallel.py does both).
Not supported across hosts: images / audio in a step, and draft-model speculative decoding (their host-side
encoders and drafter would need the same treatment).
"""
from __future__ import annotations

import atexit
import dataclasses
import logging

import jax
import numpy as np
from jax.experimental import multihost_utils

from gemmajax.engine.runner import ModelRunner, StepInputs, build_step_inputs

logger = logging.getLogger(__name__)

OP_STOP, OP_STEP = 0, 1
# int32: op, t_pad, s_pad, r_pad, greedy, hidden, decode_only bits (metas), decode_only bits (shared), and for a
# decode-steps program (runner.model_decode_steps) its steps and max_steps (0, 0: a plain step)
_HEADER = 10


def _bits(flags) -> int:
    return sum(1 << i for i, f in enumerate(flags) if f)


def _header(inp: StepInputs, greedy: bool, hidden: bool, steps: int = 0, max_steps: int = 0) -> np.ndarray:
    return np.array([OP_STEP, inp.token_ids.shape[0], inp.metas[0].kv_lens.shape[0], inp.logits_indices.shape[0],
                     int(greedy), int(hidden), _bits(m.decode_only for m in inp.metas),
                     _bits(m.decode_only for m in inp.shared_metas), steps, max_steps], np.int32)


def _template(runner: ModelRunner, hdr: np.ndarray) -> StepInputs:
    """Zero inputs with the structure and shapes the header describes (the follower's side of the broadcast)."""
    _, t, s, r, _, _, dec, sdec, _, _ = (int(x) for x in hdr)
    inp = build_step_inputs(runner.spec, [], t, s, r)
    return dataclasses.replace(
        inp, metas=tuple(dataclasses.replace(m, decode_only=bool(dec >> i & 1)) for i, m in enumerate(inp.metas)),
        shared_metas=tuple(dataclasses.replace(m, decode_only=bool(sdec >> i & 1))
                           for i, m in enumerate(inp.shared_metas)))


def _local(out):
    """A replicated step output as this host's single-device array (tuples: each part)."""
    if isinstance(out, tuple):
        return tuple(_local(o) for o in out)
    return out.addressable_data(0)


def _run_step(runner: ModelRunner, inp: StepInputs, greedy: bool, hidden: bool, steps: int, max_steps: int):
    """The step a header describes, on this host's runner."""
    if max_steps:
        return runner.forward_decode_steps(inp, steps, max_steps)
    return (runner.forward_greedy if greedy else runner.forward)(inp, hidden=hidden)


class LeaderRunner:
    """Host 0's runner: broadcasts every step to the followers, then runs it. Same interface as ModelRunner."""

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self._closed = False
        atexit.register(self.close)

    def __getattr__(self, name):          # weights, spec, kv, ...: the wrapped runner's
        return getattr(self.runner, name)

    def _run(self, inp: StepInputs, greedy: bool, hidden: bool, steps: int = 0, max_steps: int = 0):
        if inp.soft_mask is not None:
            raise NotImplementedError("multi-host serving: images / audio in a step are not broadcast to the other "
                                      "hosts yet; serve text only, or run on one host")
        inp = jax.tree.map(np.asarray, inp)        # a lookahead step's token ids may be a device array
        multihost_utils.broadcast_one_to_all(_header(inp, greedy, hidden, steps, max_steps))
        multihost_utils.broadcast_one_to_all(inp)
        return _local(_run_step(self.runner, inp, greedy, hidden, steps, max_steps))

    def forward(self, inp: StepInputs, hidden: bool = False):
        return self._run(inp, False, hidden)

    def forward_greedy(self, inp: StepInputs, hidden: bool = False):
        return self._run(inp, True, hidden)

    def forward_decode_steps(self, inp: StepInputs, steps: int, max_steps: int):
        return self._run(inp, True, False, steps, max_steps)

    def close(self) -> None:
        """Tell the followers to return from `follow` (idempotent; also run at exit)."""
        if not self._closed:
            self._closed = True
            multihost_utils.broadcast_one_to_all(np.array([OP_STOP] + [0] * (_HEADER - 1), np.int32))


def lead(engine) -> LeaderRunner:
    """Make host 0's engine broadcast its steps (engine.runner becomes a LeaderRunner)."""
    if engine.drafter is not None:
        raise NotImplementedError("multi-host serving with a draft-model speculative_config is not supported "
                                  "(the drafter's steps are not broadcast); use the ngram method")
    engine.runner = LeaderRunner(engine.runner)
    return engine.runner


def follow(runner: ModelRunner) -> int:
    """A follower host's loop: run every step host 0 broadcasts, until it sends STOP. Returns the steps run."""
    steps = 0
    logger.info("host %d of %d: following host 0's steps", jax.process_index(), jax.process_count())
    while True:
        hdr = multihost_utils.broadcast_one_to_all(np.zeros(_HEADER, np.int32))
        if int(hdr[0]) == OP_STOP:
            return steps
        inp = multihost_utils.broadcast_one_to_all(_template(runner, hdr))
        out = _run_step(runner, inp, bool(hdr[4]), bool(hdr[5]), int(hdr[8]), int(hdr[9]))
        jax.block_until_ready(out)
        steps += 1
