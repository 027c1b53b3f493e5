"""The CRD: valid for the API server, generated from one source, documented field by field."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from radixpool.operator import api
from radixpool.operator.crd import CRD_DIRS, ROOT, crd_files, inference_pool_crd

REPO = Path(__file__).resolve().parents[2]


def test_crd_files_in_repo_and_chart_are_generated_from_the_schema():
    for folder in CRD_DIRS:
        for name, text in crd_files().items():
            path = REPO / folder / name
            assert path.exists(), f"{path} missing: run python -m radixpool.operator.crd"
            assert path.read_text() == text, (
                f"{path} is stale: run `python -m radixpool.operator.crd` at the repo root")
    assert sorted(p.name for p in (REPO / "crds").glob("*.yaml")) == sorted(crd_files())


def test_crds_validate_against_the_official_apiextensions_schema(assert_k8s_valid):
    for text in crd_files().values():
        for doc in yaml.safe_load_all(text):
            assert_k8s_valid(doc)


def test_resource_identity_scale_and_printer_columns():
    crd = inference_pool_crd()
    spec = crd["spec"]
    assert (spec["group"], spec["scope"]) == ("radixpool.io", "Namespaced")
    assert spec["names"]["kind"] == "InferencePool" and spec["names"]["shortNames"] == ["llmpool"]
    version = spec["versions"][0]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {
        "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
        "labelSelectorPath": ".status.selector"}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Model"] == ".status.model" and columns["Workers"] == ".status.ready"
    # `kubectl get llmpool` tells a rejected pool from one still starting.
    assert columns["Accepted"] == '.status.conditions[?(@.type=="Accepted")].status'
    assert columns["Ready"] == '.status.conditions[?(@.type=="Ready")].status'
    assert columns["Policy"] == ".spec.gateway.policy"
    assert columns["Age"] == ".metadata.creationTimestamp"


def _walk(node: dict, path: str):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from _walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from _walk(node["items"], f"{path}[]")


def test_every_spec_and_status_field_is_typed_and_described_for_kubectl_explain():
    for root in ("spec", "status"):
        for path, node in _walk(ROOT["properties"][root], root):
            assert node.get("description"), f"{path} has no description"
            assert node.get("type") or node.get("x-kubernetes-int-or-string"), f"{path} untyped"


def test_schema_carries_defaults_ranges_enums_and_cel_rules():
    spec = ROOT["properties"]["spec"]["properties"]
    assert spec["replicas"]["default"] == 1 and spec["replicas"]["minimum"] == 0
    assert spec["gateway"]["properties"]["policy"]["enum"] == [
        "cache_aware", "round_robin", "random", "power_of_two", "prefix_hash"]
    assert spec["engine"]["properties"]["resources"]["properties"]["gpuResourceName"][
        "default"] == "nvidia.com/gpu"
    rules = [r["rule"] for r in spec["model"]["x-kubernetes-validations"]]
    assert rules == ["has(self.path) != has(self.uri)"]
    name = ROOT["properties"]["metadata"]["properties"]["name"]
    assert (name["maxLength"], name["pattern"]) == (api.MAX_POOL_NAME, api.POOL_NAME_PATTERN)


def test_example_pools_are_valid_against_the_crd_schema():
    from radixpool.operator.spec import parse_pool

    examples = sorted((REPO / "examples").glob("*.yaml"))
    assert examples, "examples/ holds no InferencePool"
    for path in examples:
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == api.KIND:
                assert doc["apiVersion"] == api.API_VERSION, path
                parse_pool(doc)  # raises InvalidPool naming the field


def test_docs_spec_reference_is_current_and_lists_every_field():
    from radixpool.operator.crd import DOCS, SPEC, spec_reference

    docs = (REPO / DOCS).read_text()
    assert spec_reference() in docs, "run `python -m radixpool.operator.crd` to refresh the docs"
    for path, _ in _walk(SPEC, "spec"):
        if path != "spec" and not path.endswith("[]"):
            assert f"| `{path}` |" in docs, path


@pytest.mark.parametrize(("name", "spec", "valid"), [
    ("pool", {"model": {"path": "/m"}}, True),
    ("pool", {"model": {"uri": "hf://a/b"}, "engine": {"kvCacheTokens": 10}}, True),
    ("pool", {"model": {"path": "/m"}, "engine": {"memFraction": 0.5}}, True),
    ("pool", {"model": {"path": "/m", "uri": "hf://a/b"}}, False),
    ("pool", {"model": {}}, False),
    ("pool", {"model": {"path": "/m"}, "engine": {"kvCacheTokens": 10, "memFraction": 0.5}},
     False),
    # less than one KV page: every worker exited at start
    ("pool", {"model": {"path": "/m"}, "engine": {"kvCacheTokens": 8, "pageSize": 16}}, False),
    ("pool", {"model": {"path": "/m"}, "engine": {"kvCacheTokens": 16, "pageSize": 16}}, True),
    # a CPU worker given --mem-fraction exited at start
    ("pool", {"model": {"path": "/m"}, "engine": {"memFraction": 0.5, "device": "cpu"}}, False),
    ("pool", {"model": {"path": "/m"}, "engine": {"memFraction": 0.5,
                                                  "resources": {"gpus": 0}}}, False),
    ("pool", {"model": {"path": "/m"}, "engine": {"memFraction": 0.5, "device": "cuda"}}, True),
    ("pool", {"model": {"path": "/m"}, "engine": {"kvCacheTokens": 10,
                                                  "resources": {"gpus": 0}}}, True),
    # refused by the operator (Accepted=False) and, as these rules, by `kubectl apply` itself
    ("pool", {"model": {"path": "/m"}, "engine": {"pageSize": 24}}, False),
    ("pool", {"model": {"path": "/m"}, "engine": {"pageSize": 256}}, True),
    ("pool", {"model": {"path": "/m"}, "engine": {"pageSize": 16, "chunkedPrefillSize": 8}},
     False),
    ("pool", {"model": {"path": "/m"}, "engine": {"device": "cuda", "resources": {"gpus": 0}}},
     False),
])
def test_cel_rules_agree_with_the_operator_validation(cel_refusals, name, spec, valid):
    """The API server's CEL rules (evaluated here by cel-python) reject exactly what the
    operator's own checks reject, so kubectl apply fails early with the same message."""
    from radixpool.operator.openapi import apply_defaults
    from radixpool.operator.spec import InvalidPool, parse_pool

    body = apply_defaults(ROOT, {"metadata": {"name": name}, "spec": spec})
    cel_ok = not cel_refusals(body)
    try:
        parse_pool(body)
        operator_ok = True
    except InvalidPool:
        operator_ok = False
    assert cel_ok == operator_ok == valid
    assert len(cel_refusals.rules) == 7


def test_cel_rules_hold_on_the_defaults_of_their_objects(cel_refusals):
    """The API server evaluates each rule on its object's schema default ({}: the nested
    defaults are not applied there) when the CRD is applied, and refuses the CRD if one fails
    ("no such key: pageSize evaluating rule ..."): every rule must pass with its fields absent."""
    import celpy

    env = celpy.Environment()
    for path, rule, _ in cel_refusals.rules:
        node = ROOT
        for key in path:
            node = node["properties"][key]
        if "default" in node:
            default = celpy.json_to_cel(node["default"])
            assert env.program(env.compile(rule)).evaluate({"self": default}), rule


@pytest.mark.parametrize("name", ["Bad_Name", "9lives", "a" * 46, "ok-pool", "a" * 45])
def test_pool_names_the_api_server_accepts_are_the_ones_the_operator_accepts(name):
    from radixpool.operator.openapi import validate
    from radixpool.operator.spec import InvalidPool, parse_pool

    schema_ok = not validate(ROOT["properties"]["metadata"], {"name": name}, "metadata")
    try:
        parse_pool({"metadata": {"name": name}, "spec": {"model": {"path": "/m"}}})
        operator_ok = True
    except InvalidPool:
        operator_ok = False
    assert schema_ok == operator_ok == (name in ("ok-pool", "a" * 45))


def test_autoscaling_examples_target_the_scale_subresource_with_exported_metrics(
        assert_k8s_valid):
    from radixpool.protocol.metrics import ALL_METRICS

    exported = {series for spec in ALL_METRICS for series in spec.series}
    docs = list(yaml.safe_load_all((REPO / "examples/autoscaling.yaml").read_text()))
    # Only core kinds in the default example: `kubectl apply` works without KEDA.
    assert [d["apiVersion"] for d in docs] == ["autoscaling/v2"]
    hpa = docs[0]
    assert_k8s_valid(hpa)
    keda = list(yaml.safe_load_all((REPO / "examples/autoscaling-keda.yaml").read_text()))
    assert [d["kind"] for d in keda] == ["ScaledObject"]
    for doc in docs + keda:
        target = doc["spec"]["scaleTargetRef"]
        assert (target["apiVersion"], target["kind"]) == (api.API_VERSION, api.KIND)
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] in exported
    query = keda[0]["spec"]["triggers"][0]["metadata"]["query"]
    assert query.split("(", 1)[1].split("{", 1)[0] in exported
