"""A tiny random Hugging Face model folder with a trained BPE tokenizer and a corpus
preprocessed with it: what the trainer's `--load-hf` tests start from."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from tpcore.data.preprocess import preprocess
from tpcore.data.train_tokenizer import train_tokenizer


def hf_model_and_data(work: Path, family: str) -> tuple[Path, torch.nn.Module]:
    """(the folder `work/llama`, the model saved there). A Llama whose embedding is padded
    past the tokenizer (as Qwen's and Llama's are); a Qwen3 (q / k norms, heads 32 wide in a
    64-wide model); a Gemma; a GPT-2; or a Mixtral. The corpus, preprocessed, is
    `work/data/docs`."""
    corpus = work / "docs.jsonl"
    corpus.write_text(
        "".join(
            json.dumps({"text": f"the cat {i % 7} sat on the mat and the dog {i % 5} ran. " * 4})
            + "\n"
            for i in range(60)
        )
    )
    tokenizer = train_tokenizer([str(corpus)], str(work / "tokenizer.json"), vocab_size=300)
    vocab = json.loads(Path(tokenizer).read_text())["model"]["vocab"]
    # A random Llama whose embedding is padded past the tokenizer (as Qwen's and Llama's are);
    # or a Qwen3 (q / k norms, heads 32 wide in a 64-wide model).
    shape = dict(
        vocab_size=len(vocab) + 5,
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=64,
        eos_token_id=vocab["<|endoftext|>"],
        bos_token_id=None,
    )
    torch.manual_seed(0)
    if family == "qwen3":
        model = transformers.Qwen3ForCausalLM(
            transformers.Qwen3Config(**shape, head_dim=32, tie_word_embeddings=False)
        ).eval()
    elif (
        family == "gemma"
    ):  # (1 + weight) norms (drawn: they start at zero), GeGLU, scaled embeddings, tied head
        model = transformers.GemmaForCausalLM(transformers.GemmaConfig(**shape, head_dim=16)).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(-0.5, 0.5)
    elif family == "gpt2":  # fused c_attn, Conv1D weights, learned positions, tied head
        gpt2 = transformers.GPT2Config(
            vocab_size=shape["vocab_size"], n_embd=64, n_layer=2, n_head=4, n_positions=64,
            eos_token_id=shape["eos_token_id"], bos_token_id=None,
        )  # fmt: skip
        model = transformers.GPT2LMHeadModel(gpt2).eval()
    elif family == "mixtral":  # 4 experts, top-2, with its balancing loss on
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(
                **shape,
                num_local_experts=4,
                num_experts_per_tok=2,
                output_router_logits=True,
                router_aux_loss_coef=0.02,
            )
        ).eval()
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape)).eval()
    folder = work / "llama"
    model.save_pretrained(folder)
    (folder / "tokenizer.json").write_text(Path(tokenizer).read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"})
    )
    preprocess(str(corpus), str(work / "data" / "docs"), tokenizer=str(folder), append_eod=True)
    return folder, model
