{{/* Names and labels shared by every template. */}}
{{- define "refit.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "refit.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "refit.selectorLabels" -}}
app.kubernetes.io/name: {{ include "refit.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "refit.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "refit.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: refit
{{- end -}}

{{- define "refit.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "refit.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The namespaces the operator watches when scoped to namespaces. */}}
{{- define "refit.watchNamespaces" -}}
{{- if .Values.watch.namespaces -}}
{{- toJson (uniq .Values.watch.namespaces) -}}
{{- else -}}
{{- toJson (list .Release.Namespace) -}}
{{- end -}}
{{- end -}}

{{/* Rules for the watched WeightRefits and fleet pods (Role or ClusterRole). */}}
{{- define "refit.workloadRules" -}}
# delete: garbage collection of finished refits (--history-limit, spec.ttlSecondsAfterFinished);
# never create: only trainers decide which checkpoint the fleet loads.
- apiGroups: [refit.rollout.dev]
  resources: [weightrefits]
  verbs: [get, list, watch, patch, update, delete]
- apiGroups: [refit.rollout.dev]
  resources: [weightrefits/status]
  verbs: [get, patch]
- apiGroups: [refit.rollout.dev]
  resources: [weightrefits/finalizers]
  verbs: [update]
# Fleet pods: read only; never create, delete or patch (a pod patch could change its spec).
- apiGroups: [""]
  resources: [pods]
  verbs: [get, list, watch]
# Every write to a pod is one patch of pods/status: the readiness-gate condition
# refit.rollout.dev/weights-ready together with the pass's progress annotation.
- apiGroups: [""]
  resources: [pods/status]
  verbs: [get, patch]
- apiGroups: [""]
  resources: [events]
  verbs: [create, patch]
{{- with .Values.adminToken.secretNames }}
# Only the named admin-token Secrets, by name; no list/watch, so no other Secret is visible.
- apiGroups: [""]
  resources: [secrets]
  resourceNames: {{ toJson (uniq .) }}
  verbs: [get]
{{- end }}
# Probe references (spec.probe.reference.configMapRef).
- apiGroups: [""]
  resources: [configmaps]
  {{- with .Values.probeReferences.configMapNames }}
  resourceNames: {{ toJson (uniq .) }}
  {{- end }}
  verbs: [get]
{{- end -}}
