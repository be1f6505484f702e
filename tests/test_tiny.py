"""tiny.py: the shipped policy, the warm-up path and its cache, the atomic rebuild."""

import pytest
import torch

from engine import tiny

# Trains or decodes a model: CI runs these again under ATEN_CPU_CAPABILITY=default (plain kernels).
pytestmark = pytest.mark.model


def same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_the_default_loads_the_shipped_weights_and_writes_no_cache(tmp_path):
    from safetensors.torch import load_file

    logs = []
    model, tok = tiny.load_tiny(str(tmp_path / "cache"), tiny.SHIPPED_WARMUP, log=logs.append)
    assert "shipped" in logs[0] and not (tmp_path / "cache").exists()
    shipped = load_file(tiny.SHIPPED / "model.safetensors")
    own = model.state_dict()
    assert all(torch.equal(own[k], v) for k, v in shipped.items())
    # The shipped tokenizer is the one build_tokenizer makes: same ids for every symbol, same specials.
    built = tiny.build_tokenizer()
    assert tok.get_vocab() == built.get_vocab() and tok.eos_token_id == built.eos_token_id
    assert tok.padding_side == "left" and tok.decode(tok("12+3=45").input_ids) == "12+3=45"
    # ... and the model is build_model's architecture.
    assert model.config.to_dict()["num_hidden_layers"] == tiny.build_model(built).config.num_hidden_layers
    assert same_weights(model, type(model).from_pretrained(tiny.SHIPPED))


def test_another_warmup_is_built_here_once_then_loaded_from_the_cache(tmp_path):
    logs = []
    built, _ = tiny.load_tiny(str(tmp_path), 3, log=logs.append)
    cached, _ = tiny.load_tiny(str(tmp_path), 3, log=logs.append)
    assert "building" in logs[0] and "from cache" in logs[1]
    assert same_weights(built, cached)
    assert not same_weights(built, tiny.build_model(tiny.build_tokenizer()))  # the warm-up moved the weights
    assert [p.name for p in tmp_path.iterdir()] == [tiny.cache_path(str(tmp_path), 3).name]  # no temp left


def test_rebuild_replaces_a_folder_whole(tmp_path):
    out = tmp_path / "policy"
    tiny.rebuild(out, steps=1, log=lambda m: None)
    first = (out / "model.safetensors").read_bytes()
    tiny.rebuild(out, steps=2, log=lambda m: None)
    assert (out / "model.safetensors").read_bytes() != first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["policy"]  # no temporary or old folder left
