{{/*
Name prefix of every object: the release name, plus "-ingero" unless the
release name already says ingero. At most 63 characters (a DNS label).
*/}}
{{- define "ingero.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if contains "ingero" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-ingero" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/*
Labels on every object. app.kubernetes.io/name is always "ingero": the
operator finds the agent pods by it (ingero_operator/settings.py AGENT_LABELS).
*/}}
{{- define "ingero.labels" -}}
app.kubernetes.io/name: ingero
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "ingero.operator.selectorLabels" -}}
app.kubernetes.io/name: ingero
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{/* The operator looks for exactly these two labels on agent pods, in its own namespace. */}}
{{- define "ingero.agent.selectorLabels" -}}
app.kubernetes.io/name: ingero
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end -}}

{{- define "ingero.operator.name" -}}
{{- printf "%s-operator" (include "ingero.fullname" .) -}}
{{- end -}}

{{- define "ingero.agent.name" -}}
{{- printf "%s-agent" (include "ingero.fullname" .) -}}
{{- end -}}

{{- define "ingero.peering.name" -}}
{{- default (include "ingero.fullname" .) .Values.operator.peering.name -}}
{{- end -}}

{{/* The Secret holding the agent API token (key "token"). */}}
{{- define "ingero.token.secretName" -}}
{{- default (printf "%s-agent-token" (include "ingero.fullname" .)) .Values.token.existingSecret -}}
{{- end -}}

{{/* The name the operator checks in agent certificates. */}}
{{- define "ingero.tls.serverName" -}}
{{- default (printf "%s.%s.svc" (include "ingero.agent.name" .) .Release.Namespace) .Values.tls.serverName -}}
{{- end -}}

{{- define "ingero.image" -}}
{{- printf "%s:%s" .image.repository (default .chart.AppVersion .image.tag) -}}
{{- end -}}

{{/*
The agent token: the value given, else the one already in the cluster (so an
upgrade keeps it), else a new random one.
*/}}
{{- define "ingero.token.value" -}}
{{- if .Values.token.value -}}
{{- .Values.token.value -}}
{{- else -}}
{{- $existing := lookup "v1" "Secret" .Release.Namespace (include "ingero.token.secretName" .) -}}
{{- $data := dig "data" "token" "" ($existing | default dict) -}}
{{- if $data -}}
{{- $data | b64dec -}}
{{- else -}}
{{- randAlphaNum 64 -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/*
"true" when the agents serve Prometheus metrics: metrics.agent.enabled, or, when that
is null, metrics.enabled.
*/}}
{{- define "ingero.agent.metrics" -}}
{{- $on := .Values.metrics.agent.enabled -}}
{{- if not (kindIs "bool" $on) -}}
{{- $on = .Values.metrics.enabled -}}
{{- end -}}
{{- if $on -}}true{{- end -}}
{{- end -}}
