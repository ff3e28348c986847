"""An exported folder's tokenizer loads in transformers' AutoTokenizer and encodes as the
tokenizer.json trained with meshwise does, for every family export writes."""

import json

import pytest

from meshwise.data.bpe import save_tokenizer, train_bpe
from meshwise.serve.export import write_tokenizer

transformers = pytest.importorskip("transformers")

# Numbers and spaced punctuation: where Qwen2's own pre-tokenizer splits otherwise.
TEXT = "What is 777 + 912?\n  def  f(x):  return x  # 1234 cafe\n"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    lines = [f"What is {i} + {7 * i % 1000}? {i + 7 * i % 1000}\n" for i in range(400)]
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    save_tokenizer(train_bpe(lines + [TEXT] * 20, 400), path)
    return path


@pytest.mark.parametrize("model_type", ["gpt2", "llama", "mistral", "qwen2", "qwen3"])
def test_autotokenizer_encodes_as_the_trained_tokenizer(tmp_path, trained, model_type):
    from tokenizers import Tokenizer

    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    write_tokenizer(trained, tmp_path, model_type)
    loaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    expected = Tokenizer.from_file(str(trained)).encode(TEXT).ids
    assert loaded(TEXT)["input_ids"] == expected
