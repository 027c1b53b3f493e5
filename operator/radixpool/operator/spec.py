"""An InferencePool's spec, validated once at the edge into frozen dataclasses.

`parse_pool(body)` applies the CRD's defaults, checks the CRD's schema and the rules the schema
expresses in CEL (which the operator cannot run), and returns a `Pool` or every `FieldError`.
Nothing downstream re-checks: the builders trust a `Pool`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from radixpool.worker.server.config import check_worker_flags

from . import api
from .crd import ROOT
from .openapi import FieldError, apply_defaults, validate

# a Hugging Face repo id: org/name, each of letters, digits, '-', '_' and '.', not '..'
HF_REPO = r"^(?!.*\.\.)[A-Za-z0-9][-A-Za-z0-9_.]*/[A-Za-z0-9][-A-Za-z0-9_.]*$"


class InvalidPool(Exception):
    """The pool cannot be accepted; `errors` name each offending field."""

    def __init__(self, errors: list[FieldError]):
        super().__init__("; ".join(str(error) for error in errors))
        self.errors = errors


@dataclass(frozen=True)
class SecretRef:
    name: str
    key: str


@dataclass(frozen=True)
class Reference:
    """An object in the pool's namespace the spec depends on; `path` is the field naming it."""

    kind: str
    name: str
    path: str


@dataclass(frozen=True)
class ModelSource:
    path: str | None
    uri: str | None
    served_name: str
    hf_token: SecretRef | None
    cache_size: str

    @property
    def pvc(self) -> tuple[str, str] | None:
        """(claim, directory inside it) for `pvc://claim/dir`."""
        if self.uri and self.uri.startswith("pvc://"):
            claim, _, directory = self.uri[len("pvc://"):].partition("/")
            return claim, directory.strip("/")
        return None

    @property
    def hf(self) -> tuple[str, str | None] | None:
        """(repo id, revision) for `hf://org/name[@rev]`."""
        if self.uri and self.uri.startswith("hf://"):
            repo, _, revision = self.uri[len("hf://"):].partition("@")
            return repo, revision or None
        return None


@dataclass(frozen=True)
class Pool:
    """A validated InferencePool. `spec` is the defaulted spec as plain data; the builders read
    the engine and gateway knobs from it and the derived facts from the properties."""

    name: str
    namespace: str
    uid: str
    generation: int
    spec: dict[str, Any]
    model: ModelSource

    @property
    def replicas(self) -> int:
        return self.spec["replicas"]

    @property
    def engine(self) -> dict[str, Any]:
        return self.spec["engine"]

    @property
    def gateway(self) -> dict[str, Any]:
        return self.spec["gateway"]

    @property
    def lifecycle(self) -> dict[str, Any]:
        return self.spec["lifecycle"]

    @property
    def api_key(self) -> SecretRef | None:
        ref = self.spec.get("apiKeySecret")
        return SecretRef(ref["name"], ref["key"]) if ref else None

    def references(self) -> list[Reference]:
        """Secrets and PersistentVolumeClaims that must exist before anything is created."""
        refs = []
        if self.api_key:
            refs.append(Reference("Secret", self.api_key.name, "spec.apiKeySecret.name"))
        if self.model.hf_token:
            refs.append(Reference("Secret", self.model.hf_token.name,
                                  "spec.model.hfTokenSecret.name"))
        if self.model.pvc:
            refs.append(Reference("PersistentVolumeClaim", self.model.pvc[0], "spec.model.uri"))
        engine = self.engine
        for i, item in enumerate(engine.get("imagePullSecrets", [])):
            refs.append(Reference("Secret", item["name"], f"spec.engine.imagePullSecrets[{i}]"))
        for i, env in enumerate(engine.get("env", [])):
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if ref and not ref.get("optional"):
                refs.append(Reference("Secret", ref["name"], f"spec.engine.env[{i}]"))
        for i, volume in enumerate(engine.get("volumes", [])):
            if "secret" in volume and not volume["secret"].get("optional"):
                refs.append(Reference("Secret", volume["secret"]["secretName"],
                                      f"spec.engine.volumes[{i}]"))
            if "persistentVolumeClaim" in volume:
                refs.append(Reference("PersistentVolumeClaim",
                                      volume["persistentVolumeClaim"]["claimName"],
                                      f"spec.engine.volumes[{i}]"))
        return refs


def parse_pool(body: dict[str, Any]) -> Pool:
    """The validated pool, or `InvalidPool` naming every bad field."""
    metadata = body.get("metadata", {})
    name = metadata.get("name", "")
    defaulted = apply_defaults(ROOT, {"spec": body.get("spec") or {}})
    errors = _check_name(name)
    errors += validate(ROOT["properties"]["spec"], defaulted["spec"], "spec")
    if not errors:
        errors += _check_rules(defaulted["spec"])
    if errors:
        raise InvalidPool(errors)
    spec = defaulted["spec"]
    model = spec["model"]
    token = model.get("hfTokenSecret")
    pool = Pool(
        name=name,
        namespace=metadata.get("namespace", "default"),
        uid=metadata.get("uid", ""),
        generation=int(metadata.get("generation", 0)),
        spec=spec,
        model=ModelSource(
            path=model.get("path"), uri=model.get("uri"),
            served_name=model.get("servedName") or name,
            hf_token=SecretRef(token["name"], token["key"]) if token else None,
            cache_size=str(model["cacheSize"]),
        ),
    )
    errors = _check_worker_command(pool)
    if errors:
        raise InvalidPool(errors)
    return pool


def _check_worker_command(pool: Pool) -> list[FieldError]:
    """`engine.args` join the flags the operator writes in one command line: what the worker
    would refuse at start (an unknown flag, a stray word, a bad value, a step budget below the
    prefill chunk), as its own parser and config of this release judge it, is refused here.
    An argument holding `$(VAR)` is only known once the kubelet expands it: not judged."""
    from .workers import worker_args  # workers builds on Pool: imported where it is used

    if any("$(" in arg for arg in pool.engine.get("args", [])):
        return []
    try:
        check_worker_flags(worker_args(pool)[1:])
    except ValueError as exc:
        return [FieldError("spec.engine.args", f"the worker refuses its command line: {exc}")]
    return []


def _check_name(name: str) -> list[FieldError]:
    if len(name) > api.MAX_POOL_NAME:
        return [FieldError("metadata.name", f"must be at most {api.MAX_POOL_NAME} characters")]
    if not re.match(api.POOL_NAME_PATTERN, name):
        return [FieldError("metadata.name", f"{name!r} must be a DNS-1035 label (lowercase "
                                            "letters, digits and '-', starting with a letter)")]
    return []


def _nonempty(value: Any) -> bool:
    return isinstance(value, str) and bool(value)


def _check_volume_source(volume: Any, path: str) -> list[FieldError]:
    """The fields of a volume source the operator reads (to check the object exists) must be
    there: core/v1 items are otherwise passed through as written."""
    for source, field in (("secret", "secretName"), ("persistentVolumeClaim", "claimName")):
        if source not in volume:
            continue
        item = volume[source]
        if not isinstance(item, dict) or not _nonempty(item.get(field)):
            return [FieldError(f"{path}.{source}.{field}", "is required (a non-empty name)")]
    return []


def _check_env(env: list[dict[str, Any]]) -> list[FieldError]:
    """The parts of each core/v1 EnvVar the operator reads: the schema passes items through as
    written, so a name or valueFrom of another type must be refused here, not met by a
    TypeError (the pool then got no status at all)."""
    errors, seen = [], set()
    for index, item in enumerate(env):
        path = f"spec.engine.env[{index}]"
        name = item.get("name")
        if not _nonempty(name):
            errors.append(FieldError(f"{path}.name", "is required (a non-empty string)"))
        elif name in api.RESERVED_ENV:
            errors.append(FieldError(f"{path}.name", f"{name!r} is set by the operator"))
        elif name in seen:
            errors.append(FieldError(f"{path}.name", f"{name!r} is set twice"))
        else:
            seen.add(name)
        source = item.get("valueFrom") or {}
        if not isinstance(source, dict):
            errors.append(FieldError(f"{path}.valueFrom", "must be an object (core/v1 "
                                                          "EnvVarSource)"))
            continue
        for kind in ("secretKeyRef", "configMapKeyRef"):
            if kind in source and not (isinstance(source[kind], dict)
                                       and _nonempty(source[kind].get("name"))
                                       and _nonempty(source[kind].get("key"))):
                errors.append(FieldError(f"{path}.valueFrom.{kind}",
                                         "needs a non-empty name and key"))
    return errors


def _check_args(args: list[str]) -> list[FieldError]:
    errors = []
    for index, arg in enumerate(args):
        name = arg.partition("=")[0]
        if len(name) < 3 or not name.startswith("--"):
            continue
        # the worker's parser takes any unambiguous prefix of a flag, as `--po` for `--port`
        key = next((f for f in sorted(api.KEY_WORKER_FLAGS) if f.startswith(name)), None)
        flag = next((f for f in sorted(api.OPERATOR_WORKER_FLAGS) if f.startswith(name)), None)
        if key:
            errors.append(FieldError(f"spec.engine.args[{index}]",
                                     f"{key!r} would show the key in the Deployment and the "
                                     "process list: name its Secret in spec.apiKeySecret"))
        elif flag:
            errors.append(FieldError(f"spec.engine.args[{index}]",
                                     f"{flag!r} is set by the operator (from the pool's own "
                                     "fields, or fixed where probes and the gateway expect it)"))
    return errors


def _check_mounts(mounts: list[Any]) -> list[FieldError]:
    errors, seen = [], set()
    for index, mount in enumerate(mounts):
        where = mount.get("mountPath") if isinstance(mount, dict) else None
        if not isinstance(where, str):
            continue
        where = where.rstrip("/") or "/"
        path = f"spec.engine.volumeMounts[{index}].mountPath"
        if where in api.RESERVED_MOUNT_PATHS:
            errors.append(FieldError(path, f"{where!r} is mounted by the operator"))
        elif where in seen:
            errors.append(FieldError(path, f"{where!r} is mounted twice"))
        seen.add(where)
    return errors


def _is_zero(count_or_percent: int | str) -> bool:
    return str(count_or_percent).rstrip("%").strip("0") == ""


def _check_rules(spec: dict[str, Any]) -> list[FieldError]:
    """The CRD's CEL rules, and the constraints only code can state."""
    errors = []
    model, engine = spec["model"], spec["engine"]
    if ("path" in model) == ("uri" in model):
        errors.append(FieldError("spec.model", "set exactly one of spec.model.path or "
                                               "spec.model.uri"))
    if "kvCacheTokens" in engine and "memFraction" in engine:
        errors.append(FieldError("spec.engine", "set at most one of spec.engine.kvCacheTokens "
                                                "and spec.engine.memFraction"))
    if engine["device"] == "cuda" and not engine["resources"]["gpus"]:
        errors.append(FieldError("spec.engine.device", "'cuda' needs spec.engine.resources.gpus "
                                                       "of at least 1: a pod given no GPU would "
                                                       "use one that belongs to another pod"))
    on_cpu = engine["device"] == "cpu" or (engine["device"] == "auto"
                                            and not engine["resources"]["gpus"])
    if "memFraction" in engine and on_cpu:
        errors.append(FieldError("spec.engine.memFraction",
                                 "sizes the KV cache from GPU memory: a CPU worker (device cpu, "
                                 "or auto with resources.gpus 0) takes spec.engine.kvCacheTokens "
                                 "instead"))
    page = engine["pageSize"]
    if page & (page - 1):
        errors.append(FieldError("spec.engine.pageSize", f"must be a power of two (the worker's "
                                                         f"--page-size), got {page}"))
    kv_tokens = engine.get("kvCacheTokens")
    if kv_tokens is not None and kv_tokens < page:
        errors.append(FieldError("spec.engine.kvCacheTokens",
                                 f"must be at least spec.engine.pageSize ({page}, one KV page), "
                                 f"got {kv_tokens}"))
    chunk = engine.get("chunkedPrefillSize")
    if chunk is not None and chunk < page:
        errors.append(FieldError("spec.engine.chunkedPrefillSize",
                                 f"must be at least spec.engine.pageSize ({page}), got {chunk}"))
    uri = model.get("uri", "")
    if uri.startswith("hf://") and not re.match(HF_REPO, uri[len("hf://"):].partition("@")[0]):
        errors.append(FieldError("spec.model.uri", "hf:// takes a Hugging Face repo id, "
                                                   "hf://org/name[@revision]"))
    if uri.startswith("pvc://") and ".." in uri[len("pvc://"):].split("/"):
        errors.append(FieldError("spec.model.uri", "the directory inside the claim must not "
                                                   "climb out of it ('..')"))
    if "hfTokenSecret" in model and not uri.startswith("hf://"):
        errors.append(FieldError("spec.model.hfTokenSecret", "only applies to hf:// models"))
    reserved = {"model", "model-cache", "tmp", "cache", "dshm"}
    for index, volume in enumerate(engine.get("volumes", [])):
        name = volume.get("name")
        if not _nonempty(name):
            errors.append(FieldError(f"spec.engine.volumes[{index}].name",
                                     "is required (a non-empty string)"))
        elif name in reserved:
            errors.append(FieldError(f"spec.engine.volumes[{index}].name",
                                     f"{name!r} is reserved by the operator"))
        errors += _check_volume_source(volume, f"spec.engine.volumes[{index}]")
    errors += _check_env(engine.get("env", []))
    errors += _check_args(engine.get("args", []))
    errors += _check_mounts(engine.get("volumeMounts", []))
    gpu_resource = engine["resources"].get("gpuResourceName")
    if gpu_resource in api.CORE_RESOURCES or str(gpu_resource).startswith("hugepages-"):
        errors.append(FieldError("spec.engine.resources.gpuResourceName",
                                 f"{gpu_resource!r} is no GPU resource (e.g. nvidia.com/gpu)"))
    lifecycle = spec["lifecycle"]
    if _is_zero(lifecycle["maxSurge"]) and _is_zero(lifecycle["maxUnavailable"]):
        errors.append(FieldError("spec.lifecycle", "maxSurge and maxUnavailable cannot both be 0"))
    return errors
