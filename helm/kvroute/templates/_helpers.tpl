{{/* Names, labels and small helpers shared by every template. */}}

{{- define "kvroute.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name, at most 63 characters (DNS label). */}}
{{- define "kvroute.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kvroute.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object of the release. */}}
{{- define "kvroute.labels" -}}
helm.sh/chart: {{ include "kvroute.chart" . }}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvroute
{{- end }}

{{/* Selector labels of the router pods. */}}
{{- define "kvroute.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: router
{{- end }}

{{- define "kvroute.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvroute.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kvroute.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/*
One Settings value as the string pydantic-settings parses from a KVROUTE_* variable: strings as they are,
everything else (numbers, booleans, lists, maps) as JSON. toJson keeps large integers out of 1e+06 notation.
*/}}
{{- define "kvroute.envValue" -}}
{{- if kindIs "string" . }}{{ . }}{{ else }}{{ toJson . }}{{ end }}
{{- end }}

{{/* Redis URL the routers use: the in-chart Redis, else redis.url, else empty (config.* decides). */}}
{{- define "kvroute.redisUrl" -}}
{{- if .Values.redis.enabled }}
{{- printf "redis://%s-redis.%s.svc:%d/0" (include "kvroute.fullname" .) .Release.Namespace (int .Values.redis.port) }}
{{- else if .Values.redis.url }}
{{- .Values.redis.url }}
{{- end }}
{{- end }}

{{- define "kvroute.redisSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvroute.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: redis
{{- end }}

{{/* Settings keys holding secrets, as a list (generated helper kvroute.secretSettings in _settings.tpl). */}}
{{- define "kvroute.secretKeys" -}}
{{- include "kvroute.secretSettings" . | trim | splitList "," | toJson }}
{{- end }}

{{/* Non-empty when config sets at least one secret key, i.e. when the chart renders its Secret. */}}
{{- define "kvroute.hasChartSecret" -}}
{{- $secretKeys := include "kvroute.secretKeys" . | fromJsonArray }}
{{- range $key, $value := .Values.config }}
{{- if and (has $key $secretKeys) (not (kindIs "invalid" $value)) (not (empty $value)) }}yes{{ end }}
{{- end }}
{{- end }}

{{/*
Kubernetes discovery in the chart. It is on when config.kubernetes_enabled is true, and also whenever
config.replicas is empty: a router in a cluster without static replicas has nothing else to route to.
*/}}
{{- define "kvroute.discoveryEnabled" -}}
{{- if or .Values.config.kubernetes_enabled (empty .Values.config.replicas) .Values.epp.enabled }}true{{ end }}
{{- end }}

{{/* Non-empty when the router watches every namespace: watchAllNamespaces, or config namespace '*' / ''. */}}
{{- define "kvroute.watchAll" -}}
{{- if or .Values.watchAllNamespaces (has (.Values.config.kubernetes_namespace | default "" | toString) (list "" "*")) }}true{{ end }}
{{- end }}

{{/*
The namespace the router watches: "*" for all; config.kubernetes_namespace when set to something other than
its Settings default; else the release namespace.
*/}}
{{- define "kvroute.watchNamespace" -}}
{{- $defaults := include "kvroute.settingsDefaults" . | fromJson }}
{{- if include "kvroute.watchAll" . }}*
{{- else if ne .Values.config.kubernetes_namespace $defaults.kubernetes_namespace }}{{ .Values.config.kubernetes_namespace }}
{{- else }}{{ .Release.Namespace }}
{{- end }}
{{- end }}

{{/*
Settings the chart derives from the deployment itself, rendered as explicit env entries of the router
container (they take precedence over the ConfigMap's envFrom, which holds config: unchanged):
  KVROUTE_KUBERNETES_ENABLED / KVROUTE_KUBERNETES_NAMESPACE  when discovery is on (see above)
  KVROUTE_REDIS_URL                                          with redis.enabled or redis.url
  KVROUTE_INFERENCE_POOL                                     with epp.enabled (templates/_epp.tpl)
*/}}
{{- define "kvroute.deploymentEnv" -}}
{{- if include "kvroute.discoveryEnabled" . }}
- name: KVROUTE_KUBERNETES_ENABLED
  value: "true"
- name: KVROUTE_KUBERNETES_NAMESPACE
  value: {{ include "kvroute.watchNamespace" . | quote }}
{{- end }}
{{- with include "kvroute.redisUrl" . }}
- name: KVROUTE_REDIS_URL
  value: {{ . | quote }}
{{- end }}
{{- include "kvroute.eppEnv" . }}
{{- end }}
