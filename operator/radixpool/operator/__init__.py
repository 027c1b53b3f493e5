"""The RadixPool operator: turns an `InferencePool` into workers, a gateway and honest status.

Pure core, thin shell. `crd` is the schema (the one source of truth for the CRD files, the
defaults and the validation); `spec` parses and validates a pool; `workers`, `gateway` and
`extras` build the desired objects from it as plain dicts; `status` turns what was observed into
status and conditions; `reconcile` wires them to a `Cluster`; `handlers` and `kube` are the kopf
and Kubernetes-API shell. Nothing here imports torch.
"""
