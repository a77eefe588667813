{{/* Endpoint-picker mode (epp.enabled): names shared by the EPP Service, the InferencePool and the router env. */}}

{{/* The gRPC Service of the endpoint picker. */}}
{{- define "kvroute.eppServiceName" -}}
{{- printf "%s-epp" (include "kvroute.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The InferencePool's name: config.inference_pool when set, else epp.inferencePool.name, else the fullname. */}}
{{- define "kvroute.poolName" -}}
{{- .Values.config.inference_pool | default .Values.epp.inferencePool.name | default (include "kvroute.fullname" .) }}
{{- end }}

{{/* The router container's settings derived from EPP mode (rendered into kvroute.deploymentEnv). */}}
{{- define "kvroute.eppEnv" -}}
{{- if .Values.epp.enabled }}
{{- if include "kvroute.watchAll" . }}
{{- fail "epp.enabled needs one watched namespace (an InferencePool lives in one): unset watchAllNamespaces / set config.kubernetes_namespace" }}
{{- end }}
- name: KVROUTE_INFERENCE_POOL
  value: {{ include "kvroute.poolName" . | quote }}
{{- end }}
{{- end }}
