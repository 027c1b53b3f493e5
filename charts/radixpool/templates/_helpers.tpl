{{- define "radixpool.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "radixpool.labels" -}}
app.kubernetes.io/name: radixpool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: radixpool
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "radixpool.selectorLabels" -}}
app.kubernetes.io/name: radixpool
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "radixpool.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "radixpool.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "radixpool.image" -}}
{{- printf "%s:%s" .image.repository (default .chart.AppVersion .image.tag) -}}
{{- end -}}

{{/* What the operator does to pools and the objects they own, in a namespace or cluster-wide. */}}
{{- define "radixpool.poolRules" }}
  # Watch pools, record handler progress in annotations, write status.
  - apiGroups: ["radixpool.io"]
    resources: ["inferencepools"]
    verbs: ["get", "list", "watch", "patch"]
  - apiGroups: ["radixpool.io"]
    resources: ["inferencepools/status"]
    verbs: ["patch"]
  # Owner references with blockOwnerDeletion.
  - apiGroups: ["radixpool.io"]
    resources: ["inferencepools/finalizers"]
    verbs: ["update"]
  # Owned objects: read to compare, server-side apply (create + patch) only when they differ.
  - apiGroups: ["apps"]
    resources: ["deployments"]
    verbs: ["get", "create", "patch"]
  - apiGroups: [""]
    resources: ["services", "serviceaccounts"]
    verbs: ["get", "create", "patch"]
  - apiGroups: ["rbac.authorization.k8s.io"]
    resources: ["roles", "rolebindings"]
    verbs: ["get", "create", "patch"]
  # Removed when a pool (or the operator's --network-policy) turns them off.
  - apiGroups: ["policy"]
    resources: ["poddisruptionbudgets"]
    verbs: ["get", "create", "patch", "delete"]
  - apiGroups: ["networking.k8s.io"]
    resources: ["networkpolicies"]
    verbs: ["get", "create", "patch", "delete"]
  - apiGroups: ["monitoring.coreos.com"]
    resources: ["servicemonitors"]
    verbs: ["get", "create", "patch", "delete"]
  # The gateway's Role grants these; RBAC lets the operator grant only what it holds.
  - apiGroups: ["discovery.k8s.io"]
    resources: ["endpointslices"]
    verbs: ["list", "watch"]
  # Status: why pods fail (crash loops, image pulls, scheduling).
  - apiGroups: [""]
    resources: ["pods"]
    verbs: ["list"]
  # Validation: a pool is accepted only when the claims (and, with rbac.readSecrets, the
  # Secrets) it names exist.
  - apiGroups: [""]
    resources: ["persistentvolumeclaims"]
    verbs: ["get"]
  # Each pool's control key, made once (an existing one answers 409: no read needed).
  - apiGroups: [""]
    resources: ["secrets"]
    verbs: ["create"{{ if .Values.rbac.readSecrets }}, "get"{{ end }}]
  # Events on pools, each made once under a name of its own (the operator's and kopf's).
  - apiGroups: [""]
    resources: ["events"]
    verbs: ["create"]
{{- end }}
