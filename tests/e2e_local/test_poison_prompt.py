"""One client repeating a prompt that overflows the model, through a real gateway in front of real
workers, with the `openai` SDK: every such request gets its own 500 `nonfinite_logits`, and
nothing else changes. The gateway's breakers stay closed (each used to count those 500s, so the
client opened every worker's breaker in turn, and then everyone got 503s), and the workers stay
in rotation: a run of them makes a worker check its model on a prompt of its own, which is
finite, so the prompts are at fault, not the worker (before, such a run would have marked it
broken for good, and the kubelet would have restarted it).

The checkpoint is the tiny model with one token's embedding row set to NaN: a prompt that holds
that token gets NaN logits, any other prompt is served as usual.
"""

from __future__ import annotations

import shutil

import httpx
import openai
import pytest
from safetensors.torch import load_file, save_file

from radixpool.fleet.fleet import FleetSpec, LocalFleet
from radixpool.worker.config import EngineConfig
from radixpool.worker.engine_core import EngineCore
from radixpool.worker.messages import GenerateRequest
from radixpool.worker.sampling_params import SamplingParams
from radixpool.worker.server.nonfinite_watch import PROBE_OUTPUT_TOKENS, probe_prompt

from .fleet_probes import MODEL, eventually, gateway_view

BREAKER_FAILURES = 2
RUN = 8                # the workers' --unhealthy-after-nonfinite (default)
POISON_REQUESTS = 20   # on 2 workers, one gets at least 10 in a row: it checks its model
GOOD_PROMPT = [15, 16, 17, 18, 19, 20]


def greedy_ids(model, prompt: list[int], tokens: int) -> list[int]:
    core = EngineCore(EngineConfig(str(model), device="cpu"))
    core.add_request(GenerateRequest("r", prompt, SamplingParams(
        max_new_tokens=tokens, temperature=0, ignore_eos=True), seed=0))
    out: list[int] = []
    while core.has_work:
        for delta in core.step().deltas:
            out += delta.token_ids
    return out


@pytest.fixture(scope="module")
def poisoned_fleet(tiny_model, tmp_path_factory):
    """(fleet, the poisoned token): a token neither the worker's self-check nor the good prompt
    reads or writes."""
    weights = load_file(tiny_model / "model.safetensors")
    vocab = weights["model.embed_tokens.weight"].shape[0]
    probe = probe_prompt(vocab)
    used = set(probe + greedy_ids(tiny_model, probe, PROBE_OUTPUT_TOKENS) + GOOD_PROMPT
               + greedy_ids(tiny_model, GOOD_PROMPT, 8))
    token = next(t for t in range(vocab - 1, 0, -1) if t not in used)
    path = tmp_path_factory.mktemp("poisoned-model")
    shutil.copytree(tiny_model, path, dirs_exist_ok=True)
    weights["model.embed_tokens.weight"][token] = float("nan")
    save_file(weights, path / "model.safetensors")
    fleet = LocalFleet(FleetSpec(
        model=path, workers=2, port=0, served_model_name=MODEL, kv_cache_tokens=4096,
        gateway_args=("--breaker-failures", str(BREAKER_FAILURES)),
        log_dir=tmp_path_factory.mktemp("poisoned-fleet-logs")))
    try:
        fleet.start()
        yield fleet, token
    finally:
        fleet.stop()


def test_a_client_repeating_a_poison_prompt_takes_no_worker_out(poisoned_fleet):
    fleet, token = poisoned_fleet
    sdk = openai.OpenAI(base_url=fleet.base_url, api_key="unused", max_retries=0, timeout=120)
    greedy = {"model": MODEL, "max_tokens": 8, "temperature": 0,
              "extra_body": {"ignore_eos": True}}
    served = sdk.completions.create(prompt=GOOD_PROMPT, **greedy).choices[0].text
    for i in range(POISON_REQUESTS):
        with pytest.raises(openai.InternalServerError) as raised:
            sdk.completions.create(prompt=[10, 11, token, 12 + i], **greedy)
        assert raised.value.code == "nonfinite_logits", raised.value
        assert "non-finite logits" in raised.value.message
    view = gateway_view(fleet.gateway.url)
    assert [(w["circuit_breaker"], w["eligible"]) for w in view.values()] == \
        [("closed", True)] * 2, view
    assert all(w["breaker_failures"] == {} for w in view.values()), view
    # a worker that met a run of them checked its model, found it finite, and kept serving
    faults = {w.url: nonfinite_total(w.url) for w in fleet.workers}
    assert sum(faults.values()) == POISON_REQUESTS and max(faults.values()) >= RUN, faults
    for worker in fleet.workers:
        if faults[worker.url] >= RUN:
            eventually(lambda w=worker: "their prompts are at fault" in w.log_path.read_text(),
                       f"{worker.url} checks its model")
    for worker in fleet.workers:
        assert httpx.get(worker.url + "/health").status_code == 200, worker.url
        assert httpx.get(worker.url + "/livez").status_code == 200, worker.url
    for _ in range(4):   # every worker still gets traffic and serves it as before
        assert sdk.completions.create(prompt=GOOD_PROMPT, **greedy).choices[0].text == served


def nonfinite_total(worker_url: str) -> int:
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    line = next(x for x in text.splitlines() if x.startswith("radixpool_nonfinite_logits_total "))
    return int(float(line.split()[1]))
