{{/* Endpoint-picker mode (epp.enabled): names shared by the EPP Service, the InferencePool and the router env. */}}

{{/* The gRPC Service of the endpoint picker. */}}
{{- define "kvroute.eppServiceName" -}}
{{- printf "%s-epp" (include "kvroute.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The InferencePool's name: config.inference_pool when set, else epp.inferencePool.name, else the fullname. */}}
{{- define "kvroute.poolName" -}}
{{- .Values.config.inference_pool | default .Values.epp.inferencePool.name | default (include "kvroute.fullname" .) }}
{{- end }}

{{/* Where a mounted TLS Secret (epp.tls.secretName) appears in the router container. */}}
{{- define "kvroute.eppTlsDir" -}}
/etc/kvroute/epp-tls
{{- end }}

{{/* The EPP Service port's appProtocol: epp.appProtocol, else http2 (gRPC over TLS) or kubernetes.io/h2c
(plaintext, config.epp_grpc_insecure). */}}
{{- define "kvroute.eppAppProtocol" -}}
{{- .Values.epp.appProtocol | default (ternary "kubernetes.io/h2c" "http2" (eq (toString .Values.config.epp_grpc_insecure) "true")) }}
{{- end }}

{{/* The router container's settings derived from EPP mode (rendered into kvroute.deploymentEnv). */}}
{{- define "kvroute.eppEnv" -}}
{{- if .Values.epp.enabled }}
{{- if include "kvroute.watchAll" . }}
{{- fail "epp.enabled needs one watched namespace (an InferencePool lives in one): unset watchAllNamespaces / set config.kubernetes_namespace" }}
{{- end }}
- name: KVROUTE_INFERENCE_POOL
  value: {{ include "kvroute.poolName" . | quote }}
{{- if .Values.epp.tls.secretName }}
- name: KVROUTE_EPP_TLS_CERT_FILE
  value: {{ printf "%s/tls.crt" (include "kvroute.eppTlsDir" .) | quote }}
- name: KVROUTE_EPP_TLS_KEY_FILE
  value: {{ printf "%s/tls.key" (include "kvroute.eppTlsDir" .) | quote }}
{{- end }}
{{- end }}
{{- end }}
