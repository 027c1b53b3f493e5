"""On a GPU: greedy tokens of a small random-weight model (a real architecture, FlashInfer's head
size) equal Hugging Face `transformers` on the same GPU for the first tokens, with every attention
backend, page sizes 1 and 16, CUDA graphs on and off; a second round hits the radix cache and
gives the same tokens.

Skipped without CUDA (these machines have none): the CPU equivalence is
`test_engine_equivalence.py`, the backends' CPU conformance `test_attention_conformance.py`.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from radixpool.worker.config import EngineConfig
from radixpool.worker.engine_core import EngineCore
from radixpool.worker.messages import GenerateRequest
from radixpool.worker.model.reference_configs import write_reference_config
from radixpool.worker.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (none on this machine)")
# bf16 rounding makes near-ties flip after a while: compare the first tokens only.
FIRST_TOKENS = 8
SMALL = dict(num_hidden_layers=4, hidden_size=512, intermediate_size=1024,
             num_attention_heads=8, num_key_value_heads=2, head_dim=64, vocab_size=4096,
             max_position_embeddings=4096, bos_token_id=1, eos_token_id=2)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    path = write_reference_config(tmp_path_factory.mktemp("qwen3-small"), "qwen3-0.6b", **SMALL)
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path),
                                          dtype=torch.bfloat16)
    hf.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def prompts_and_reference(model_dir):
    from transformers import AutoModelForCausalLM

    rng = random.Random(0)
    shared = [rng.randrange(5, 4000) for _ in range(300)]
    prompts = [[rng.randrange(5, 4000) for _ in range(rng.randint(5, 400))] for _ in range(6)]
    prompts += [shared + [11, 12], shared + [21, 22, 23]]
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).cuda().eval()
    expected = []
    for ids in prompts:
        out = hf.generate(torch.tensor([ids], device="cuda"), max_new_tokens=FIRST_TOKENS,
                          min_new_tokens=FIRST_TOKENS, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    return prompts, expected


def generate(core: EngineCore, prompts: list[list[int]], tag: str) -> list[list[int]]:
    params = SamplingParams(max_new_tokens=FIRST_TOKENS, temperature=0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        assert core.add_request(GenerateRequest(f"{tag}{i}", ids, params, seed=0)) is None
    tokens: dict[str, list[int]] = {f"{tag}{i}": [] for i in range(len(prompts))}
    while core.has_work:
        for delta in core.step().deltas:
            tokens[delta.rid] += delta.token_ids
    core.check_invariants()
    return [tokens[f"{tag}{i}"] for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["torch", "flashinfer"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("cuda_graph", [False, True])
def test_greedy_equals_transformers_on_gpu(model_dir, prompts_and_reference, backend, page_size,
                                           cuda_graph):
    if backend == "flashinfer" and importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer-python is not installed")
    prompts, expected = prompts_and_reference
    core = EngineCore(EngineConfig(model_dir, device="cuda", attention_backend=backend,
                                   page_size=page_size, cuda_graph=cuda_graph,
                                   kv_cache_tokens=32768, max_running_requests=16,
                                   debug_invariants=True))
    assert (core.runner.decode_graphs is not None) == (cuda_graph and backend == "flashinfer")
    assert generate(core, prompts, "a") == expected
    assert generate(core, prompts, "b") == expected   # served from the radix cache
