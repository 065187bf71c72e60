"""RankConfig: the per-rank view of a model config that tpcore.hf gives attention modules
reading head counts from `self.config` (Phi-3)."""

from __future__ import annotations

import copy
import pickle

import pytest
import transformers

from tpcore.hf.tensor_parallel.rank_config import RankConfig


def _view():
    config = transformers.Phi3Config(num_attention_heads=8, num_key_value_heads=2, hidden_size=64)
    return config, RankConfig(config, {"num_attention_heads": 4, "num_key_value_heads": 1})


def test_per_rank_fields_and_the_rest_of_the_config():
    config, view = _view()
    assert (view.num_attention_heads, view.num_key_value_heads) == (4, 1)
    assert (config.num_attention_heads, config.num_key_value_heads) == (
        8,
        2,
    )  # the model's own stays whole
    assert view.hidden_size == 64 and view.rope_parameters == config.rope_parameters
    with pytest.raises(AttributeError):
        view.no_such_field


def test_writes_reach_the_models_config_and_per_rank_fields_refuse_them():
    config, view = _view()
    config._attn_implementation = "eager"
    assert (
        view._attn_implementation == "eager"
    )  # a later change of the model's config reaches the view
    view.sliding_window = 7
    assert config.sliding_window == 7
    with pytest.raises(AttributeError, match="this rank's share"):
        view.num_attention_heads = 2
    assert view.num_attention_heads == 4 and config.num_attention_heads == 8


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_copies_keep_the_view(how):
    _, view = _view()
    other = copy.deepcopy(view) if how == "deepcopy" else pickle.loads(pickle.dumps(view))
    assert isinstance(other, RankConfig)
    assert (other.num_attention_heads, other.hidden_size) == (4, 64)
