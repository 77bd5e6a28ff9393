"""Sampling on the CuPy backend: its greedy tokens equal the reference's on
the tiny preset (fp32; on the stand-ins where no GPU is)."""

from tests.test_sample_backends import TINY, greedy_on


def test_cupy_greedy_tokens_are_the_reference_s():
    want, got = greedy_on("cupy", TINY, tokens=9)
    assert len(want) == 14 and len(set(want[5:])) > 1 and got == want
