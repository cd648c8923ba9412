"""What a GPU node without the Hugging Face hub needs at run time beyond the wheelhouse (docs/offline.md): the
paper's Llama tokenizer from a local tokenizer.json (`data.tokenizer.path`), a one-line error that names that
fix when a hub tokenizer is neither cached nor reachable (HF_HUB_OFFLINE respected: the hub is not asked)."""

import huggingface_hub
import pytest
from huggingface_hub.utils import LocalEntryNotFoundError
from tokenizers import Tokenizer
from ttt_bench.cli.main import main

from tests.conftest import TINY
from tests.helpers import cli_error
from ttt_bench.data.tokenizers import from_spec
from ttt_bench.errors import UserError
from ttt_bench.training.checkpoint import load_checkpoint

NOT_CACHED = "ttt-bench-tests/no-such-tokenizer"


@pytest.mark.parametrize("where", ["folder", "file"])
def test_a_local_tokenizer_json_loads_without_the_hub(tokenizer_dir, no_hub, where):
    path = tokenizer_dir if where == "folder" else tokenizer_dir / "tokenizer.json"
    tok = from_spec({"kind": "hf", "name": "meta-llama/Llama-2-7b-hf", "path": str(path), "eos_token": None})
    text = "Zepibi holds the code"
    assert tok.decode(tok.encode(text)) == text and tok.eos_id == tok.tok.token_to_id("</s>")
    # the spec (saved in checkpoints) carries the tokenizer itself, not where it lay
    assert tok.spec["name"] == "meta-llama/Llama-2-7b-hf" and "path" not in tok.spec and "json" in tok.spec
    assert from_spec(tok.spec).encode(text).tolist() == tok.encode(text).tolist()


def test_training_with_data_tokenizer_path_on_an_offline_node(tokenizer_dir, no_hub, tmp_path, capsys):
    main(["train", "model=transformer", "size=xs", *TINY, "trainer.max_steps=2", "data.tokenizer.kind=hf",
          f"data.tokenizer.path={tokenizer_dir}", f"paths.runs={tmp_path / 'runs'}"])
    (ckpt,) = (tmp_path / "runs").glob("*/*/checkpoints/last.ckpt")
    module, tok = load_checkpoint(ckpt)
    local = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    assert module.hparams["vocab_size"] == tok.vocab_size == local.get_vocab_size() and "path" not in tok.spec


def test_an_uncached_hub_tokenizer_offline_is_one_line_naming_data_tokenizer_path(no_hub, capsys, tmp_path):
    err = cli_error(capsys, tmp_path, "train", *TINY, "data.tokenizer.kind=hf",
                    f"+data.tokenizer.name={NOT_CACHED}")
    assert f"'{NOT_CACHED}' is not in the local hub cache and HF_HUB_OFFLINE is set" in err
    assert "set data.tokenizer.path=DIR" in err


@pytest.mark.parametrize("failure,message", [
    (LocalEntryNotFoundError("connection refused"), "the hub cannot be reached: set data.tokenizer.path=DIR"),
    (ValueError("gated"), "could not load Hugging Face tokenizer 'org/model' (ValueError)"),
])
def test_a_hub_that_fails_names_the_local_fix(monkeypatch, failure, message):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)

    def download(*args, **kwargs):
        raise failure

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with pytest.raises(UserError, match="data.tokenizer.path") as e:
        from_spec({"kind": "hf", "name": "org/model"})
    assert message in str(e.value)


def test_a_bad_tokenizer_path_says_what_is_there(tmp_path):
    with pytest.raises(UserError, match="no tokenizer.json there"):
        from_spec({"kind": "hf", "path": str(tmp_path)})
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(UserError, match="is not a tokenizers tokenizer.json"):
        from_spec({"kind": "hf", "path": str(tmp_path)})
