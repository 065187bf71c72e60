"""GPTConfig.from_hf / to_hf against transformers' own config classes (no process group):
each family both ways, both spellings of the rope settings, the rotary frequencies against
transformers', refusals that name the option, and the trainer's --load-hf flag checks."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from tpcore.hf.gpt_bridge import config_from_hf, config_to_hf  # noqa: E402

transformers = pytest.importorskip("transformers")

from checks import expect_error  # noqa: E402
from tpcore.models import GPTConfig  # noqa: E402
from tpcore.models.common import rotary_frequencies  # noqa: E402
from tpcore.train.arguments import parse_args  # noqa: E402

SMALL = dict(
    vocab_size=99,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=96,
    max_position_embeddings=256,
)
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def _families():
    return {
        "llama": transformers.LlamaConfig(
            **SMALL, rope_theta=5e5, rope_scaling=dict(LLAMA3), attention_bias=True
        ),  # a copy: transformers edits the dict
        "qwen2": transformers.Qwen2Config(**SMALL, tie_word_embeddings=True, rms_norm_eps=1e-5),
        "mistral": transformers.MistralConfig(
            **SMALL, sliding_window=128, head_dim=32
        ),  # Mistral-Nemo's wider heads
        "qwen3": transformers.Qwen3Config(**SMALL, head_dim=16, attention_bias=True),
        "gemma": transformers.GemmaConfig(**SMALL, head_dim=16),
        "gpt2": transformers.GPT2Config(
            vocab_size=99,
            n_embd=64,
            n_layer=3,
            n_head=4,
            n_positions=128,
            activation_function="gelu",
        ),
    }


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "gemma", "gpt2"])
def test_from_hf_to_hf_round_trip(family):
    hf = _families()[family]
    config = config_from_hf(hf)
    exported = config_to_hf(config, hf.to_dict())
    assert exported["model_type"] == family
    back = transformers.AutoConfig.for_model(**exported)  # transformers reads what to_hf writes
    assert type(back) is type(hf)
    assert config_from_hf(back) == config
    assert config_from_hf(config_to_hf(config)) == config  # without the source config too
    if family == "gpt2":
        assert (config.norm, config.activation, config.position_embedding, config.bias) == (
            "layernorm",
            "gelu_exact",
            "learned",
            True,
        )
        assert config.ffn_hidden_size == 256 and config.tie_embeddings
    elif family == "gemma":  # (1 + weight) norms, GeGLU, embeddings times sqrt(hidden), tied head
        assert (config.norm, config.activation, config.position_embedding) == (
            "gemma_rmsnorm",
            "geglu",
            "rotary",
        )
        assert (
            config.embedding_scale == 8.0
            and config.tie_embeddings
            and exported["hidden_act"] == "gelu_pytorch_tanh"
        )
    else:
        assert (config.norm, config.activation, config.position_embedding) == (
            "rmsnorm",
            "swiglu",
            "rotary",
        )
        assert (
            config.num_kv_heads == 4
            and config.ffn_hidden_size == 96
            and config.norm_eps == hf.rms_norm_eps
        )
    assert config.embedding_scale is None or family == "gemma"
    if family == "llama":
        assert config.rotary_base == 5e5 and config.rotary_scaling == LLAMA3
        assert (config.qkv_bias, config.proj_bias, config.mlp_bias, config.tie_embeddings) == (
            True,
            True,
            False,
            False,
        )
    if family == "qwen2":
        assert (config.qkv_bias, config.proj_bias, config.mlp_bias, config.tie_embeddings) == (
            True,
            False,
            False,
            True,
        )
    if family == "mistral":
        assert (
            config.sliding_window == 128
        )  # shorter than the context: GPTModel refuses longer sequences
    if family in ("mistral", "qwen3", "gemma"):
        assert (
            config.kv_channels
            == config.head_dim
            == {"mistral": 32, "qwen3": 16, "gemma": 16}[family]
            != config.hidden_size // config.num_attention_heads
        )
    else:
        assert config.kv_channels is None  # head_dim = hidden / heads: nothing to keep
    assert config.qk_norm == (family == "qwen3")
    if family == "qwen3":
        assert (config.qkv_bias, config.proj_bias, config.mlp_bias) == (True, True, False)


def test_both_rope_spellings():
    """4.x wrote rope_theta + rope_scaling ("type" or "rope_type"); 5.x writes rope_parameters."""
    base = dict(
        model_type="llama",
        vocab_size=99,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=8,
        intermediate_size=96,
    )
    old = config_from_hf(
        {**base, "rope_theta": 1e6, "rope_scaling": {"type": "linear", "factor": 2.0}}
    )
    new = config_from_hf(
        {**base, "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
    )
    assert (
        old == new
        and old.rotary_base == 1e6
        and old.rotary_scaling == {"rope_type": "linear", "factor": 2.0}
    )
    plain = config_from_hf({**base, "rope_theta": 3e4, "rope_scaling": None})
    assert plain.rotary_base == 3e4 and plain.rotary_scaling is None
    written = config_to_hf(old)
    assert written["rope_theta"] == 1e6 and written["rope_scaling"] == {
        "rope_type": "linear",
        "factor": 2.0,
    }
    assert written["rope_parameters"] == {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}


@pytest.mark.parametrize("scaling", [None, {"rope_type": "linear", "factor": 4.0}, LLAMA3])
def test_rotary_frequencies_match_transformers(scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(
        **SMALL, rope_theta=5e5, rope_scaling=dict(scaling) if scaling else None
    )
    if scaling is None:
        expected = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(config=hf).inv_freq
    else:
        expected, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](hf, "cpu")
    config = config_from_hf(hf)
    got = rotary_frequencies(config.head_dim, config.rotary_base, config.rotary_scaling)
    torch.testing.assert_close(got, expected.float(), rtol=1e-6, atol=0)
    if scaling is not None:  # the scaling changed something, so the comparison could fail
        assert not torch.allclose(
            got, rotary_frequencies(config.head_dim, config.rotary_base, None)
        )


@pytest.mark.parametrize(
    "change, words",
    [
        (
            {"model_type": "gpt_neox"},
            ["'gpt_neox'", "parallel residual", "supported: gpt2, llama, mistral, qwen2"],
        ),
        ({"model_type": "bert"}, ["'bert'", "not supported"]),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, ["rope_type='yarn'"]),
        ({"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}, ["rope_type='dynamic'"]),
        ({"hidden_act": "gelu"}, ["hidden_act='gelu'"]),
        ({"partial_rotary_factor": 0.5}, ["partial_rotary_factor"]),
        ({"num_hidden_layers": None}, ["num_hidden_layers"]),
    ],
)
def test_unsupported_types_and_options_are_named(change, words):
    config = {**transformers.LlamaConfig(**SMALL).to_dict(), **change}
    # the 4.x spelling alone (transformers 5 also writes rope_parameters)
    if "rope_scaling" in change:
        config.pop("rope_parameters", None)
    if config.get("num_hidden_layers", 1) is None:
        del config["num_hidden_layers"]
    with pytest.raises(ValueError) as info:
        config_from_hf(config)
    assert all(w in str(info.value) for w in words), str(info.value)


def test_gpt2_options_and_to_hf_refusals():
    for option, value in (
        ("scale_attn_by_inverse_layer_idx", True),
        ("scale_attn_weights", False),
        ("activation_function", "relu"),
    ):
        with pytest.raises(ValueError, match=option):
            config_from_hf({**transformers.GPT2Config().to_dict(), option: value})
    with pytest.raises(ValueError, match="no supported Hugging Face family"):
        config_to_hf(
            GPTConfig(
                vocab_size=10, num_layers=1, hidden_size=8, num_attention_heads=2, norm="rmsnorm"
            )
        )
    with pytest.raises(ValueError, match="grouped-query"):
        config_to_hf(
            GPTConfig(
                vocab_size=10, num_layers=1, hidden_size=8, num_attention_heads=2, num_kv_heads=1
            )
        )
    gemma = dict(
        vocab_size=10,
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        norm="gemma_rmsnorm",
        activation="geglu",
        position_embedding="rotary",
        bias=False,
        embedding_scale=4.0,
    )
    assert config_to_hf(GPTConfig(**gemma))["model_type"] == "gemma"
    with pytest.raises(
        ValueError,
        match=r"Gemma has no embedding_scale \(must be sqrt\(hidden_size\)\), MLP biases",
    ):
        config_to_hf(GPTConfig(**{**gemma, "embedding_scale": 2.0, "mlp_bias": True}))
    with pytest.raises(
        ValueError,
        match="no supported Hugging Face family has norm='layernorm', activation='geglu'",
    ):
        config_to_hf(
            GPTConfig(
                vocab_size=10,
                num_layers=1,
                hidden_size=8,
                num_attention_heads=2,
                activation="geglu",
            )
        )  # (a KeyError)
    with pytest.raises(ValueError, match="only gemma scales its embeddings"):
        config_to_hf(GPTConfig(**{**gemma, "norm": "rmsnorm", "activation": "swiglu"}))
    with pytest.raises(ValueError, match="hidden_act='relu'"):
        config_from_hf({**transformers.GemmaConfig(**SMALL).to_dict(), "hidden_act": "relu"})
    with pytest.raises(
        ValueError, match="embedding_scale must be None or a positive finite number"
    ):
        GPTConfig(**{**gemma, "embedding_scale": 0})
    with pytest.raises(FileNotFoundError, match="config.json"):
        config_from_hf("/nonexistent/model")


def test_new_fields_default_to_todays_model():
    """A config saved before these fields existed builds the same model."""
    c = GPTConfig(vocab_size=10, num_layers=1, hidden_size=8, num_attention_heads=2, bias=False)
    assert (c.qkv_bias, c.proj_bias, c.mlp_bias, c.rotary_scaling, c.sliding_window) == (
        False,
        False,
        False,
        None,
        None,
    )
    with pytest.raises(ValueError, match="rope_type"):
        GPTConfig(
            vocab_size=10,
            num_layers=1,
            hidden_size=8,
            num_attention_heads=2,
            position_embedding="rotary",
            rotary_scaling={"factor": 2},
        )
    GPTConfig(
        vocab_size=10, num_layers=1, hidden_size=8, num_attention_heads=4, num_kv_heads=2
    ).check_tp(4)  # replicated, as tpcore.hf does
    with pytest.raises(
        ValueError,
        match=r"num_kv_heads \(3\) and the tensor-parallel size \(4\): one must divide the other",
    ):
        GPTConfig(
            vocab_size=10, num_layers=1, hidden_size=24, num_attention_heads=12, num_kv_heads=3
        ).check_tp(4)


def test_trainer_flags_against_load_hf(tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(transformers.LlamaConfig(**SMALL).to_dict()))
    (folder / "tokenizer.json").write_text("{}")
    args = parse_args(["--load-hf", str(folder), "--seq-length", "32"])
    assert (
        args.num_layers,
        args.hidden_size,
        args.num_kv_heads,
        args.norm,
        args.activation,
        args.disable_bias,
    ) == (2, 64, 4, "rmsnorm", "swiglu", True)
    assert args.tokenizer == str(folder)  # the folder's tokenizer.json
    config = args.model_config()
    assert config.vocab_size == 99 and config.position_embedding == "rotary"
    assert (
        parse_args(["--load-hf", str(folder), "--num-layers", "2"]).num_layers == 2
    )  # agreeing flags pass
    # --kv-channels at the folder's width (64 / 8) agrees, however config.json spells it.
    assert (
        parse_args(["--load-hf", str(folder), "--seq-length", "32", "--kv-channels", "8"])
        .model_config()
        .kv_channels
        is None
    )
    wide = tmp_path / "wide"
    wide.mkdir()
    (wide / "config.json").write_text(
        json.dumps(transformers.LlamaConfig(**SMALL, head_dim=16).to_dict())
    )
    (wide / "tokenizer.json").write_text("{}")
    assert (
        parse_args(["--load-hf", str(wide), "--seq-length", "32"]).model_config().kv_channels == 16
    )
    expect_error(
        ValueError,
        "--kv-channels 8 contradicts --load-hf",
        parse_args,
        ["--load-hf", str(wide), "--seq-length", "32", "--kv-channels", "8"],
    )
    for flags, words in (
        (["--num-layers", "3"], ["--num-layers 3", "gives 2"]),
        (["--norm", "layernorm"], ["--norm 'layernorm'"]),
        (["--position-embedding", "learned"], ["--position-embedding"]),
        (["--seq-length", "512"], ["--seq-length 512", "max_position_embeddings 256"]),
    ):
        with pytest.raises(ValueError) as info:
            parse_args(["--load-hf", str(folder), *flags])
        assert all(w in str(info.value) for w in words), str(info.value)
    with pytest.raises(ValueError, match="is not a folder"):
        parse_args(["--load-hf", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="--save-hf: .*no supported Hugging Face family"):
        parse_args(["--norm", "rmsnorm", "--save-hf", str(tmp_path / "out")])


def test_save_hf_into_the_load_hf_folder_is_refused(tmp_path, monkeypatch):
    """--save-hf naming the --load-hf folder (under any spelling) would train every step,
    overwrite the model it started from, then fail copying tokenizer.json onto itself:
    refused when the arguments are read (every rank alike, before training)."""
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(transformers.LlamaConfig(**SMALL).to_dict()))
    (folder / "tokenizer.json").write_text("{}")
    (tmp_path / "link").symlink_to(folder, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    for same in (str(folder), "llama/", "./link", str(tmp_path / "link" / ".." / "llama")):
        expect_error(
            ValueError,
            f"--save-hf {same} is the --load-hf folder llama: export into a folder of its own",
            parse_args,
            ["--load-hf", "llama", "--seq-length", "32", "--save-hf", same],
        )
    expect_error(
        ValueError,
        "--save-hf ckpt is the --save folder",
        parse_args,
        ["--save", "./ckpt", "--save-hf", "ckpt"],
    )
    assert (
        parse_args(
            ["--load-hf", "llama", "--seq-length", "32", "--save-hf", "llama-continued"]
        ).save_hf
        == "llama-continued"
    )


def test_save_hf_holding_the_runs_output_folders_is_refused(tmp_path, monkeypatch):
    """--save-hf above --save or --log-dir passed the check at startup (the folder was still
    empty), trained every step, then the export refused the folder for the checkpoints the
    run had written into it: refused when the arguments are read."""
    monkeypatch.chdir(tmp_path)
    expect_error(
        ValueError,
        (
            "--save-hf out holds the --save folder out/ckpt: "
            "the export would find the run's files there"
        ),
        parse_args,
        ["--save", "out/ckpt", "--save-hf", "out"],
    )
    expect_error(
        ValueError,
        "--save-hf ./out holds the --log-dir folder out/logs/run1",
        parse_args,
        ["--log-dir", "out/logs/run1", "--save-hf", "./out"],
    )
    assert (
        parse_args(["--save", "out/ckpt", "--save-hf", "out/ckpt-hf"]).save_hf == "out/ckpt-hf"
    )  # beside it
    assert (
        parse_args(["--save", "ckpt", "--save-hf", "ckpt/hf"]).save_hf == "ckpt/hf"
    )  # inside it: the checkpoints are untouched


def test_head_width_spellings_and_families():
    """kv_channels equal to hidden / heads is the default width (one spelling: Llama 3's
    config.json writes head_dim, Megatron scripts pass --kv-channels); a hidden size the
    heads do not divide exports as Mistral, since transformers' LlamaConfig refuses it."""
    base = dict(
        vocab_size=99,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        norm="rmsnorm",
        activation="swiglu",
        position_embedding="rotary",
        bias=False,
    )
    assert (
        GPTConfig(**base, kv_channels=8) == GPTConfig(**base)
        and GPTConfig(**base, kv_channels=8).kv_channels is None
    )
    folder_config = transformers.LlamaConfig(
        **SMALL, head_dim=8
    ).to_dict()  # head_dim written, equal to 64 / 8
    assert config_from_hf(folder_config) == config_from_hf(
        transformers.LlamaConfig(**SMALL).to_dict()
    )
    odd = GPTConfig(**{**base, "hidden_size": 60}, kv_channels=16, num_kv_heads=2)
    exported = config_to_hf(odd)
    assert exported["model_type"] == "mistral" and exported["head_dim"] == 16
    assert (
        config_from_hf(transformers.AutoConfig.for_model(**exported)) == odd
    )  # transformers builds it
    with pytest.raises(ValueError, match="hidden_size 60 not divisible by num_attention_heads 8"):
        config_to_hf(dataclasses.replace(odd, qkv_bias=True, proj_bias=True))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_keys_left_out_read_as_transformers_reads_them(family):
    """A hand-written config.json without head_dim (Qwen3's default: 128) or the window keys
    (4096 from layer 28): from_hf reads what transformers builds from the same dict."""
    cls = {"qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[family]
    d = cls(
        **{**SMALL, "num_hidden_layers": 30, "max_position_embeddings": 8192},
        use_sliding_window=True,
    ).to_dict()
    for key in ("head_dim", "sliding_window", "max_window_layers", "layer_types"):
        d.pop(key, None)
    mine, theirs = config_from_hf(d), config_from_hf(transformers.AutoConfig.for_model(**d))
    assert mine == theirs
    assert mine.sliding_window == 4096 and mine.head_dim == (128 if family == "qwen3" else 8)
