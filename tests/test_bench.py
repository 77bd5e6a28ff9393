"""`coppelius bench` and its PyTorch peer. The peer must be the same model as
the reference (same loss, same gradients, same update), or its timings
compare nothing. No test here asserts a time."""

import math

import pytest

from coppelius import reference
from coppelius.conformance import cases
from coppelius.conformance.tolerances import relative_error, tolerance
from coppelius import bench
from coppelius.reference.params import registry

TEST = reference.preset("test")


def peer_module():
    pytest.importorskip("torch")
    from coppelius.bench import torch_peer

    return torch_peer


@pytest.mark.parametrize("batch", [1, 2])
def test_torch_peer_is_the_reference_model(batch):
    torch_peer = peer_module()
    state = cases.random_state(TEST, seed=3, scale=1.0)  # norms away from ones and zeros
    tokens = cases.random_windows(TEST, batch, 1)[0]
    want = reference.step(TEST, state.copy(), tokens, "fp32", grads=True)
    peer = torch_peer.TorchPeer(TEST, state.P)
    loss, row_losses, G = peer.loss_and_grads(tokens)
    assert loss == pytest.approx(float(want.loss), rel=1e-4)
    assert relative_error(row_losses, want.row_losses)[0] <= tolerance("row_losses", "fp32")
    for spec in registry(TEST):  # autograd against the hand-written backward, per tensor
        error, *_ = relative_error(G[spec.slice], want.grads[spec.slice])
        assert error <= tolerance("gradient", "fp32"), spec.name


@pytest.mark.parametrize("optimizer", ["torch", "hand"])
def test_torch_peer_update_is_adamw_of_the_spec(optimizer):
    torch_peer = peer_module()
    state = cases.fresh_state(TEST)
    windows = cases.random_windows(TEST, 1, 3)
    peer = torch_peer.TorchPeer(TEST, state.P, optimizer=optimizer)
    want = state
    for tokens in windows:  # three updates: bias corrections for t = 1, 2, 3
        loss = float(peer.step(peer.to_tokens(tokens)))
        result = reference.step(TEST, want, tokens, "fp32")
        want = result.state
        assert loss == pytest.approx(float(result.loss), rel=1e-4)
    P = peer.parameters_flat()
    # the update itself (P - P0), which weight decay and bias correction shape:
    # without decay it would be off by ~2e-3, with a wrong c1 by far more
    error, *_ = relative_error(P - state.P, want.P - state.P)
    assert error < 5e-4
    assert relative_error(P, want.P)[0] <= tolerance("P", "fp32")


def test_torch_peer_refuses_bf16_on_the_cpu():
    torch_peer = peer_module()
    with pytest.raises(ValueError, match="CUDA"):
        torch_peer.TorchPeer(TEST, cases.fresh_state(TEST).P, precision="bf16", device="cpu")


def test_flops_per_step_counts_the_usual_estimate():
    c = reference.preset("coppelius")
    # SPEC preset: 57,705,472 parameters; 6 N T + 6 L D T^2 per context
    assert bench.flops_per_step(c, 1) == 6 * 57705472 * 1024 + 6 * 16 * 512 * 1024 ** 2
    assert bench.flops_per_step(c, 8) == 8 * bench.flops_per_step(c, 1)


def timing(name, device, precision, ms, preset="test"):
    return bench.Timing(name, device, precision, ms, [math.nan] * len(ms), 1.0, 16, preset, 1e9)


def test_table_ratios_compare_with_the_matching_peer():
    peers = [timing("torch peer", "cpu", "fp32", [10.0, 30.0, 20.0])]  # median 20
    rows = [timing("reference", "cpu", "fp32", [40.0, 40.0]), timing("mlx", "gpu", "fp32", [5.0]),
            timing("reference (coppelius)", "cpu", "fp32", [9000.0], preset="coppelius")] + peers
    lines = bench.format_table(rows, peers).splitlines()
    assert lines[0].split()[:2] == ["implementation", "device"]
    assert "2.00" in lines[1].split()  # 40 / 20
    assert "0.25 (cpu fp32)" in lines[2]  # no gpu peer: compared with the cpu baseline
    assert lines[3].split()[-2] == "-"  # another preset: no ratio
    assert lines[4].split()[-2] == "-"  # the peer itself


def test_bench_command_prints_a_table(capsys):
    from coppelius.cli import main

    assert main(["bench", "--preset", "test", "--steps", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("coppelius bench: preset test, B=1, T=16, 2 timed steps")
    assert out[1].split()[:3] == ["implementation", "device", "precision"]
    names = [line.split()[0] for line in out[2:]]
    assert names[0] == "reference"
    from coppelius import accelerated

    for name in accelerated.available_backends():
        assert name in names
    try:
        import torch  # noqa: F401

        assert "torch" in names
    except ImportError:
        assert any("no PyTorch peer" in line for line in out)
    # every implementation trained the same model on the same inputs from the same bits
    losses = {float(line.split()[-1]) for line in out[2:] if line.split()[0] in ("reference", "torch")}
    assert len(losses) == 1 or max(losses) - min(losses) < 1e-4 * max(losses)


def test_bench_refuses_bad_options_in_one_line(capsys):
    from coppelius.cli import main

    assert main(["bench", "--preset", "test", "--steps", "0"]) == 2
    assert main(["bench", "--preset", "nonesuch"]) == 2
    assert main(["bench", "--preset", "test", "--backend", "nonesuch"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("coppelius bench: error: ") for line in err)
