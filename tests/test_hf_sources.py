"""The separator in a Hugging Face export (SPEC 22): a run whose BPE was
trained with --eos exports it as tokenizer_config.json's `eos_token` and
generation_config.json's `eos_token_id`, transformers' tokenizer and
generation config name it, and `generate` stops where it comes. Needs
transformers and torch (`tox -e hf`)."""

import json
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.test_hf_directory import SMALL, stdlib_text, trained_like  # noqa: E402

from coppelius.cli import main  # noqa: E402
from coppelius.tokenizer import tokenizer_sha, train_tokenizer  # noqa: E402
from coppelius.reference import State  # noqa: E402
from coppelius.reference.checkpoint import identities, write_checkpoint  # noqa: E402
from coppelius.reference.config import Hyper  # noqa: E402

pytestmark = pytest.mark.hf
EOS = "<|endoftext|>"


def test_generate_stops_at_the_exported_separator(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    tok = train_tokenizer([stdlib_text("json")], SMALL.vocab, eos=EOS)
    tok.save(str(run / "tokenizer.json"))
    eos_id = tok.token_to_id(EOS)
    ids = identities(SMALL, Hyper(lr="1/1000"), "fp32", 2, tokenizer_sha(run / "tokenizer.json"),
                     "d" * 64)
    P = trained_like(SMALL)
    write_checkpoint(run / "checkpoint.bin", SMALL, ids, State.fresh(P), contexts=0)
    out = tmp_path / "hf"
    assert main(["export", str(run / "checkpoint.bin"), str(out), "--format", "hf"]) == 0, \
        capsys.readouterr().err
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == EOS
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == eos_id
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.eos_token == EOS and hf_tok.eos_token_id == eos_id
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == eos_id

    class EosAtThird(transformers.LogitsProcessor):
        """The third new token is the separator, the others anything but."""

        def __init__(self, start):
            self.start = start

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            if input_ids.shape[1] - self.start == 2:
                scores[:, :] = -float("inf")
                scores[:, eos_id] = 0.0
            else:
                scores[:, eos_id] = -float("inf")
            return scores

    prompt = hf_tok("def", return_tensors="pt").input_ids
    got = model.generate(prompt, max_new_tokens=12, do_sample=False,
                         logits_processor=transformers.LogitsProcessorList(
                             [EosAtThird(prompt.shape[1])]))
    assert got.shape[1] == prompt.shape[1] + 3 and int(got[0, -1]) == eos_id
