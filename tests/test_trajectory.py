"""A 20-step training trajectory of the `test` preset under each policy (and
of each family preset, SPEC 21), and the reference's training program (SPEC
section 13) replaying it.

fixtures/trajectory_test.json keeps the 20 mean losses of each policy, to
catch any change of the numbers. They are compared within 1e-6 relative,
not bit for bit: the matrix products go through the machine's BLAS, whose
float32 summation order depends on the CPU (kernel choice, blocking,
threads), so another machine legitimately differs in the last bits, and
20 steps of AdamW amplify that a little. 1e-6 is ~16 float32 ulps of the
loss; a real change of the semantics moves the losses by far more. Under
bf16 a last-bit difference of a float32 sum can also flip the rounding of
an operand to bfloat16 (a step of 2^-8 relative in that element), so the
spread between machines is larger: 2.8e-6 was seen, and bf16 gets 5e-6.
Regenerate (only when the semantics change on purpose) with
    COPPELIUS_REGEN_FIXTURES=1 python -m pytest tests/test_trajectory.py
"""

import json
import os

import numpy as np
import pytest

from coppelius import reference
from coppelius.reference.config import Hyper
from coppelius.reference.program import capture

CONFIG = reference.preset("test")
STEPS, BATCH, SEED = 20, 2, 20260925
REL_TOL = {"fp32": 1e-6, "bf16": 5e-6}
FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "fixtures", "trajectory_test.json")


FAMILY = ["test-llama", "test-qwen", "test-stablelm"]  # SPEC 21's presets, at the test size


def fixed_tokens():
    """One fixed (B, T+1) batch, trained on at every step: the losses must fall."""
    return np.random.default_rng(SEED).integers(0, CONFIG.vocab, (BATCH, CONFIG.context + 1))


def trajectory(policy, config=CONFIG):
    state = reference.State.fresh(reference.initialize(config))
    tokens = fixed_tokens()
    losses = []
    for _ in range(STEPS):
        result = reference.step(config, state, tokens, policy)
        losses.append(result.loss)
        state = result.state
    return np.array(losses, dtype=np.float32), state


def test_regenerate_trajectory_fixture():
    """Writes fixtures/trajectory_test.json when COPPELIUS_REGEN_FIXTURES=1."""
    if os.environ.get("COPPELIUS_REGEN_FIXTURES") != "1":
        pytest.skip("set COPPELIUS_REGEN_FIXTURES=1 to rewrite fixtures/trajectory_test.json")
    doc = {"preset": "test", "steps": STEPS, "batch": BATCH,
           "tokens": f"np.random.default_rng({SEED}).integers(0, vocab, (batch, context + 1)), every step",
           "losses": {policy: [repr(float(x)) for x in trajectory(policy)[0]] for policy in ("fp32", "bf16")}}
    with open(FIXTURE, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


@pytest.fixture(scope="module")
def fixture():
    with open(FIXTURE) as f:
        return json.load(f)


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
def test_losses_fall_and_match_the_fixture(policy, fixture):
    losses, state = trajectory(policy)
    assert state.t == STEPS
    assert np.isfinite(losses).all()
    # a fixed batch is memorized: the loss falls well below its start (~ln 64)
    assert losses[-1] < losses[0] - 0.2, losses
    assert (np.diff(losses) < 0).sum() >= STEPS - 3, losses  # and almost every step goes down
    want = np.array([float(x) for x in fixture["losses"][policy]], dtype=np.float32)
    assert fixture["steps"] == STEPS and fixture["batch"] == BATCH
    err = np.abs(losses.astype(np.float64) - want) / want
    i = int(np.argmax(err))
    assert err[i] <= REL_TOL[policy], f"{policy}: step {i + 1} loss {losses[i]!r}, fixture {want[i]!r}"


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILY)
def test_a_family_member_learns_a_fixed_batch(name, policy):
    """No fixture of the family's numbers (the reference would be its own
    witness; the whole-step tests check them): its losses fall as the
    defaults' do, and the policies differ."""
    losses, state = trajectory(policy, reference.preset(name))
    assert state.t == STEPS and np.isfinite(losses).all()
    assert losses[-1] < losses[0] - 0.2, losses
    assert (np.diff(losses) < 0).sum() >= STEPS - 3, losses
    other = trajectory("bf16" if policy == "fp32" else "fp32", reference.preset(name))[0]
    assert 4 * REL_TOL["bf16"] < (np.abs(losses - other) / losses).max() < 1e-3


def test_policies_give_different_trajectories(fixture):
    fp32 = np.array([float(x) for x in fixture["losses"]["fp32"]])
    bf16 = np.array([float(x) for x in fixture["losses"]["bf16"]])
    rel = np.abs(fp32 - bf16) / fp32
    assert rel.max() > 4 * REL_TOL["bf16"]  # the policy acts, beyond the fixture's tolerance
    assert rel.max() < 1e-3  # and bf16 still trains the same model


# ---------------------------------------------------------------- the training program
def batches(n):
    rng = np.random.default_rng(3)
    return [rng.integers(0, CONFIG.vocab, (BATCH, CONFIG.context + 1)) for _ in range(n)]


@pytest.mark.parametrize("policy", ["fp32", "bf16"])
@pytest.mark.parametrize("name", ["test"] + FAMILY)
def test_replay_equals_the_reference_step(policy, name):
    config = reference.preset(name)
    state = reference.State.fresh(reference.initialize(config))
    program = capture(config, Hyper(), policy, BATCH, state)
    assert (program.backend, program.config, program.precision, program.batch) == (
        "reference", config, policy, BATCH)
    # capture performs no training update
    s0 = program.state()
    assert s0.t == 0 and np.array_equal(s0.P, state.P) and not s0.M.any() and not s0.V.any()
    for tokens in batches(3):
        want = reference.step(config, state, tokens, policy, Hyper(), grads=True)
        program.upload_input(tokens)
        loss = program.replay_and_wait()
        assert isinstance(loss, float) and loss == float(want.loss)
        np.testing.assert_array_equal(program.row_losses(), want.row_losses)
        np.testing.assert_array_equal(program.gradients(), want.grads)
        got = program.state()
        for name in "PMV":
            np.testing.assert_array_equal(getattr(got, name), getattr(want.state, name), err_msg=name)
        assert got.t == want.state.t
        state = want.state
    np.testing.assert_array_equal(program.logits(batches(1)[0][:, :-1]),
                                  reference.forward(config, state.P, batches(1)[0][:, :-1], policy))
    assert program.state().t == 3
