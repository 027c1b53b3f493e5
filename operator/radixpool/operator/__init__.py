"""The RadixPool operator: turns an `InferencePool` into workers, a gateway and honest status.

Pure core, thin shell:
- `api` names things; `crd` is the schema, the one source of the CRD files, their defaults and
  ranges, and the spec reference in docs/kubernetes.md; `openapi` applies that schema's defaults
  and checks as the API server does;
- `spec` parses and validates a pool into a `Pool`;
- `workers`, `gateway` and `desired` build the objects the pool owns, as plain dicts;
- `status` turns what was observed into status and conditions;
- `reconcile` runs one pass against a `Cluster`; `kube` is that `Cluster` over the Kubernetes API;
- `handlers` (kopf) and `cli` (`radixpool operator`) are the process;
- `dashboards` builds the Grafana dashboards from the metric definitions.
Nothing here imports torch.
"""
