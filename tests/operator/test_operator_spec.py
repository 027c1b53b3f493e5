"""Validation: what a user gets back for a bad pool names the field and says what was expected."""

from __future__ import annotations

import pytest

from radixpool.operator.spec import InvalidPool, parse_pool


def errors_of(body) -> dict[str, str]:
    with pytest.raises(InvalidPool) as caught:
        parse_pool(body)
    return {error.path: error.message for error in caught.value.errors}


def test_minimal_pool_gets_the_schema_defaults(pool_body):
    pool = parse_pool(pool_body())
    assert pool.replicas == 1
    assert pool.model.served_name == "llama"
    assert pool.engine["resources"]["gpus"] == 1
    assert pool.engine["resources"]["gpuResourceName"] == "nvidia.com/gpu"
    assert pool.engine["schedulePolicy"] == "lpm" and pool.engine["pageSize"] == 1
    assert pool.gateway["policy"] == "cache_aware" and pool.gateway["cacheThreshold"] == 0.3
    assert pool.gateway["service"] == {"type": "ClusterIP", "port": 8080}
    assert pool.lifecycle["drainTimeoutSeconds"] == 120
    assert pool.lifecycle["podDisruptionBudget"] == {"enabled": True, "maxUnavailable": 1}


@pytest.mark.parametrize(("spec", "field", "expected"), [
    ({"model": {}}, "spec.model", "exactly one of spec.model.path or spec.model.uri"),
    ({"model": {"path": "/m", "uri": "hf://a/b"}}, "spec.model", "exactly one"),
    ({"model": {"uri": "s3://bucket/model"}}, "spec.model.uri", "does not match"),
    ({"model": {"path": "relative/dir"}}, "spec.model.path", "does not match"),
    ({"model": {"uri": "hf://org/name/extra/../x"}}, "spec.model.uri", "repo id"),
    ({"model": {"uri": "hf://org/na..me"}}, "spec.model.uri", "repo id"),
    ({"model": {"uri": "pvc://claim/models/../../etc"}}, "spec.model.uri", "climb out"),
    ({"replicas": -1}, "spec.replicas", "at least 0"),
    ({"gateway": {"policy": "fastest"}}, "spec.gateway.policy", "must be one of cache_aware"),
    ({"gateway": {"cacheThreshold": 1.5}}, "spec.gateway.cacheThreshold", "at most 1"),
    ({"gateway": {"balanceRelThreshold": 0.5}}, "spec.gateway.balanceRelThreshold",
     "at least 1"),
    ({"engine": {"pageSize": 0}}, "spec.engine.pageSize", "at least 1"),
    # int32 fields: the API server does not enforce `format`; the worker failed at start
    ({"engine": {"kvCacheTokens": 2**31}}, "spec.engine.kvCacheTokens", "at most 2147483647"),
    ({"gateway": {"balanceAbsThreshold": 2**40}}, "spec.gateway.balanceAbsThreshold",
     "at most 2147483647"),
    # the worker refuses these (as memFraction 1): an Accepted pool had every worker exit at start
    ({"engine": {"pageSize": 12}}, "spec.engine.pageSize", "power of two"),
    ({"engine": {"pageSize": 16, "chunkedPrefillSize": 8}}, "spec.engine.chunkedPrefillSize",
     "at least spec.engine.pageSize (16)"),
    ({"engine": {"memFraction": 0}}, "spec.engine.memFraction", "greater than 0"),
    ({"engine": {"memFraction": 1}}, "spec.engine.memFraction", "less than 1"),
    ({"engine": {"kvCacheTokens": 1000, "memFraction": 0.5}}, "spec.engine", "at most one"),
    ({"engine": {"resources": {"gpus": -1}}}, "spec.engine.resources.gpus", "at least 0"),
    # A pod given no GPU would take one of the node's that belongs to another pod.
    ({"engine": {"device": "cuda", "resources": {"gpus": 0}}}, "spec.engine.device",
     "resources.gpus of at least 1"),
    ({"engine": {"resources": {"memory": "lots"}}}, "spec.engine.resources.memory",
     "not a valid"),
    ({"engine": {"resources": {"cpu": "-1"}}}, "spec.engine.resources.cpu", "not a valid"),
    ({"model": {"path": "/m", "cacheSize": "-10Gi"}}, "spec.model.cacheSize", "not a valid"),
    ({"engine": {"schedulePolicy": "sjf"}}, "spec.engine.schedulePolicy", "lpm, fcfs"),
    ({"engine": {"volumes": [{"name": "tmp", "emptyDir": {}}]}}, "spec.engine.volumes[0].name",
     "reserved"),
    # what the operator reads or sets itself: refused here, not by server-side apply's 500 or
    # a KeyError in the handler (the pool then had no status at all)
    ({"engine": {"env": [{"name": "HOME", "value": "/x"}]}}, "spec.engine.env[0].name",
     "set by the operator"),
    # appended last, they won: `--port` moved the worker off its probes' and gateway's port
    ({"engine": {"args": ["--port", "9000"]}}, "spec.engine.args[0]",
     "'--port' is set by the operator"),
    ({"engine": {"args": ["--context-length", "4096", "--page-size=32"]}}, "spec.engine.args[2]",
     "'--page-size' is set by the operator"),
    ({"engine": {"args": ["--po", "9000"]}}, "spec.engine.args[0]", "'--port'"),
    # a key on the command line is in the Deployment for anyone who may read it, and in `ps`
    ({"engine": {"args": ["--api-key", "sk-live"]}}, "spec.engine.args[0]",
     "spec.apiKeySecret"),
    ({"engine": {"args": ["--skip-warmup", "--api-key=sk-live"]}}, "spec.engine.args[1]",
     "spec.apiKeySecret"),
    ({"engine": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}},
     "spec.engine.env[1].name", "set twice"),
    ({"engine": {"env": [{"name": "X", "valueFrom": {"secretKeyRef": {"key": "k"}}}]}},
     "spec.engine.env[0].valueFrom.secretKeyRef", "non-empty name and key"),
    # core/v1 items pass the schema as written: the parts the operator reads are checked here
    # (a TypeError left the pool with no status, the handler retried every minute)
    ({"engine": {"env": [{"name": "A", "valueFrom": "secretKeyRef"}]}},
     "spec.engine.env[0].valueFrom", "must be an object"),
    ({"engine": {"env": [{"name": "A", "valueFrom": ["secretKeyRef"]}]}},
     "spec.engine.env[0].valueFrom", "must be an object"),
    ({"engine": {"env": [{"name": ["A"], "value": "1"}]}}, "spec.engine.env[0].name",
     "is required (a non-empty string)"),
    ({"engine": {"env": [{"value": "1"}]}}, "spec.engine.env[0].name", "is required"),
    ({"engine": {"volumes": [{"name": ["v"], "emptyDir": {}}]}}, "spec.engine.volumes[0].name",
     "is required (a non-empty string)"),
    ({"engine": {"volumes": [{"name": "d", "secret": {}}]}},
     "spec.engine.volumes[0].secret.secretName", "required"),
    ({"engine": {"volumes": [{"name": "d", "secret": None}]}},
     "spec.engine.volumes[0].secret.secretName", "required"),
    # an empty name read the whole collection: a 403 that looked like missing RBAC
    ({"engine": {"volumes": [{"name": "d", "persistentVolumeClaim": {"claimName": ""}}]}},
     "spec.engine.volumes[0].persistentVolumeClaim.claimName", "required"),
    ({"engine": {"volumeMounts": [{"name": "d", "mountPath": "/tmp/"}]}},
     "spec.engine.volumeMounts[0].mountPath", "mounted by the operator"),
    ({"engine": {"volumeMounts": [{"name": "d", "mountPath": "/x"},
                                  {"name": "e", "mountPath": "/x"}]}},
     "spec.engine.volumeMounts[1].mountPath", "mounted twice"),
    ({"engine": {"resources": {"gpuResourceName": "memory"}}},
     "spec.engine.resources.gpuResourceName", "no GPU resource"),
    ({"engine": {"pagesize": 16}}, "spec.engine.pagesize", "unknown field"),
    ({"lifecycle": {"drainTimeoutSeconds": -5}}, "spec.lifecycle.drainTimeoutSeconds",
     "at least 0"),
    ({"lifecycle": {"maxSurge": 0, "maxUnavailable": 0}}, "spec.lifecycle", "both be 0"),
    ({"lifecycle": {"maxSurge": "00%", "maxUnavailable": 0}}, "spec.lifecycle", "both be 0"),
    # what the Deployment or PodDisruptionBudget would refuse, in its own terms (an Accepted=False
    # naming spec.strategy.rollingUpdate): refused here and by the CRD, naming the pool's field
    ({"lifecycle": {"maxSurge": "1"}}, "spec.lifecycle.maxSurge", "not a valid"),
    ({"lifecycle": {"maxSurge": -1}}, "spec.lifecycle.maxSurge", "at least 0"),
    ({"lifecycle": {"maxUnavailable": "150%"}}, "spec.lifecycle.maxUnavailable", "not a valid"),
    ({"lifecycle": {"podDisruptionBudget": {"maxUnavailable": -1}}},
     "spec.lifecycle.podDisruptionBudget.maxUnavailable", "at least 0"),
    ({"lifecycle": {"podDisruptionBudget": {"maxUnavailable": "2"}}},
     "spec.lifecycle.podDisruptionBudget.maxUnavailable", "not a valid"),
    ({"engine": {"resources": {"cpu": -2}}}, "spec.engine.resources.cpu", "at least 0"),
    # a pod naming such an image is refused: the Deployment never got a pod (Degraded)
    ({"engine": {"image": "repo/worker:1 "}}, "spec.engine.image", "does not match"),
    ({"gateway": {"image": "repo/my gateway"}}, "spec.gateway.image", "does not match"),
    ({"gateway": {"resources": {"memory": -1}}}, "spec.gateway.resources.memory", "at least 0"),
    ({"gateway": {"service": {"port": 70000}}}, "spec.gateway.service.port", "at most 65535"),
    ({"replicas": "three"}, "spec.replicas", "type integer"),
])
def test_invalid_field_is_named_with_what_was_expected(pool_body, spec, field, expected):
    body = pool_body()
    body["spec"] = {"model": {"path": "/models/m"}, **spec}
    errors = errors_of(body)
    assert field in errors, errors
    assert expected in errors[field]


@pytest.mark.parametrize("interval", ["30s", "1m30s", "1h", "500ms", "2m"])
def test_a_scrape_interval_prometheus_takes_is_accepted(pool_body, interval):
    # only <n>ms, <n>s or <n>m were: 1m30s and 1h, which Prometheus and prometheus-operator
    # take, were refused
    body = pool_body(monitoring={"serviceMonitor": {"interval": interval}})
    assert parse_pool(body).spec["monitoring"]["serviceMonitor"]["interval"] == interval


@pytest.mark.parametrize("interval", ["", "1.5m", "30", "1m 30s", "30sec"])
def test_a_scrape_interval_prometheus_refuses_is_refused(pool_body, interval):
    body = pool_body(monitoring={"serviceMonitor": {"interval": interval}})
    assert "spec.monitoring.serviceMonitor.interval" in errors_of(body)


@pytest.mark.parametrize("lifecycle", [
    {"maxSurge": "250%", "maxUnavailable": "100%"},
    {"maxSurge": 0, "maxUnavailable": 3, "podDisruptionBudget": {"maxUnavailable": "50%"}},
])
def test_rollout_counts_kubernetes_takes_are_accepted(pool_body, lifecycle):
    assert parse_pool(pool_body(lifecycle=lifecycle)).lifecycle["maxSurge"] == lifecycle["maxSurge"]


def test_worker_flags_the_operator_does_not_set_pass_through(pool_body):
    args = ["--max-prefill-tokens", "16384", "--context-length=8192", "--skip-warmup",
            "--control-api-key-file", "/keys/control", "--eviction-policy", "lfu"]
    assert parse_pool(pool_body(engine={"args": args})).engine["args"] == args
    # the kubelet expands $(VAR) from the container's env: the operator cannot judge it
    expanded = ["--max-prefill-tokens", "$(STEP_TOKENS)"]
    assert parse_pool(pool_body(engine={"args": expanded})).engine["args"] == expanded


@pytest.mark.parametrize(("engine", "says"), [
    ({"args": ["--skip-warmup", "4096"]}, "unrecognized arguments: 4096"),
    ({"args": ["--no-such-flag"]}, "unrecognized arguments: --no-such-flag"),
    ({"args": ["--help"]}, "unrecognized arguments: --help"),   # prints usage, exits 0
    ({"args": ["--eviction-policy", "mru"]}, "invalid choice: 'mru'"),
    ({"args": ["--max-prefill-tokens", "1024"]},
     "--max-prefill-tokens must be ≥ chunked_prefill_size (2048)"),
    ({"chunkedPrefillSize": 4096, "args": ["--max-prefill-tokens=4000"]},
     "--max-prefill-tokens must be ≥ chunked_prefill_size (4096)"),
    ({"args": ["--context-length", "0"]}, "--context-length must be ≥ 1"),
])
def test_a_worker_command_line_the_worker_refuses_is_refused(pool_body, engine, says):
    """engine.args join the operator's flags in the worker's command line: one the worker
    refuses was Accepted=True over worker pods that exited at start, every one of them."""
    errors = errors_of(pool_body(engine=engine))
    assert list(errors) == ["spec.engine.args"]
    assert "the worker refuses its command line" in errors["spec.engine.args"]
    assert says in errors["spec.engine.args"]


def test_all_problems_are_reported_at_once(pool_body):
    errors = errors_of(pool_body(replicas=-1, gateway={"policy": "x"}))
    assert {"spec.replicas", "spec.gateway.policy"} <= set(errors)


def test_missing_model_and_bad_name(pool_body):
    body = pool_body(name="Bad_Name")
    del body["spec"]["model"]
    errors = errors_of(body)
    assert errors["spec.model"] == "is required"
    assert "DNS-1035" in errors["metadata.name"]
    assert "at most 45" in errors_of(pool_body(name="a" * 46))["metadata.name"]


def test_model_uris_are_understood(pool_body):
    hf = parse_pool(pool_body(model={"uri": "hf://Qwen/Qwen3-8B@abc123"}))
    assert hf.model.hf == ("Qwen/Qwen3-8B", "abc123") and hf.model.pvc is None
    pvc = parse_pool(pool_body(model={"uri": "pvc://models/llama/8b"}))
    assert pvc.model.pvc == ("models", "llama/8b")


def test_references_name_the_field_that_points_at_them(pool_body):
    pool = parse_pool(pool_body(
        apiKeySecret={"name": "key"},
        model={"uri": "hf://org/gated", "hfTokenSecret": {"name": "hf"}},
        engine={"imagePullSecrets": [{"name": "regcred"}],
                "env": [{"name": "X", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}],
                "volumes": [{"name": "data", "persistentVolumeClaim": {"claimName": "data"}}]}))
    found = {(ref.kind, ref.name, ref.path) for ref in pool.references()}
    assert found == {
        ("Secret", "key", "spec.apiKeySecret.name"),
        ("Secret", "hf", "spec.model.hfTokenSecret.name"),
        ("Secret", "regcred", "spec.engine.imagePullSecrets[0]"),
        ("Secret", "s", "spec.engine.env[0]"),
        ("PersistentVolumeClaim", "data", "spec.engine.volumes[0]"),
    }


@pytest.mark.parametrize("fraction", [1e-6, 0.5, 0.999, 1, 1.5])
def test_pool_takes_a_mem_fraction_exactly_when_its_workers_do(pool_body, fraction):
    """An Accepted pool whose workers refuse their --mem-fraction would crash-loop every pod."""
    from radixpool.worker.config import EngineConfig
    try:
        EngineConfig(model_path="/m", mem_fraction=fraction)
        worker_takes_it = True
    except ValueError:
        worker_takes_it = False
    try:
        parse_pool(pool_body(engine={"memFraction": fraction}))
        pool_takes_it = True
    except InvalidPool:
        pool_takes_it = False
    assert pool_takes_it == worker_takes_it
