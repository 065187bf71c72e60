"""The trainer's sampling with pipeline parallelism: the stages' pieces gathered on the first
stage make exactly the dense ReferenceGPT (at this TP rank), and greedy generation from
it gives the dense model's tokens; the other stages get None."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

import tpcore
from checks import GPT_VARIANTS
from tpcore import parallel_state
from tpcore.models import ReferenceGPT, generate
from tpcore.pipeline_parallel import build_gpt_stages
from tpcore.pipeline_parallel.gather import gather_model_on_first_stage


def _gather(rank, world, tp, pp, v):
    tpcore.initialize_model_parallel(tensor_parallel_size=tp, pipeline_parallel_size=pp)
    first = dist.get_rank(parallel_state.get_pipeline_model_parallel_group()) == 0
    prompt = torch.tensor([[1, 2, 3], [4, 5, 6]])
    for variant in ("gpt2", "llama"):
        torch.manual_seed(4)
        dense = ReferenceGPT(dataclasses.replace(GPT_VARIANTS[variant], num_layers=4)).eval()
        chunks = build_gpt_stages(dense.config, num_model_chunks=v, _init=False)
        for chunk in chunks:
            chunk.load_dense_state_dict(dense.state_dict())
        model = gather_model_on_first_stage(chunks)
        if not first:
            assert model is None
            continue
        if pp == 1:
            assert model is chunks[0]
        gathered = model.to_dense().state_dict()  # a collective over the first stage's TP group
        assert gathered.keys() == dense.state_dict().keys()
        for name, t in dense.state_dict().items():
            assert torch.equal(gathered[name], t), f"{variant}: {name}"
        tokens = generate(model, prompt, 6, greedy=True)
        assert torch.equal(tokens, generate(dense, prompt, 6, greedy=True)), variant


@pytest.mark.parametrize("tp,pp,v", [(2, 2, 1), (1, 4, 1), (1, 2, 2), (2, 1, 1)])
def test_gathered_model_is_the_dense_model(cpu_ranks, tp, pp, v):
    cpu_ranks.run(_gather, tp, pp, v)
