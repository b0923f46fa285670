{{/*
Every name comes from one value, the pool (pool.name, default: the release name): several pools, each its
own release, share a namespace without a collision. `vllm-tuner inject` derives the same names from the
pod's vllm-tuner.io/pool annotation (tuner/kube/injecting.py).
*/}}
{{- define "vllm-tuner.pool" -}}
{{- $pool := .Values.pool.name | default .Release.Name -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $pool) -}}
{{- fail (printf "pool.name %q: a DNS label (lower-case letters, digits, '-'), e.g. llama-8b" $pool) -}}
{{- end -}}
{{- if gt (len $pool) 40 -}}
{{- fail (printf "pool.name %q: at most 40 characters (the names made from it must fit in 63)" $pool) -}}
{{- end -}}
{{- $pool -}}
{{- end -}}

{{- define "vllm-tuner.fullname" -}}
vllm-tuner-{{ include "vllm-tuner.pool" . }}
{{- end -}}

{{- define "vllm-tuner.labels" -}}
app.kubernetes.io/name: vllm-tuner
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
vllm-tuner.io/pool: {{ include "vllm-tuner.pool" . | quote }}
{{- end -}}

{{- define "vllm-tuner.lease" -}}
{{ include "vllm-tuner.fullname" . }}
{{- end -}}

{{- define "vllm-tuner.journal" -}}
vllm-tuner-journal-{{ include "vllm-tuner.pool" . }}
{{- end -}}

{{- define "vllm-tuner.config" -}}
vllm-tuner-config-{{ include "vllm-tuner.pool" . }}
{{- end -}}

{{- define "vllm-tuner.pdb" -}}
{{ .Values.pdb.name | default (include "vllm-tuner.pool" .) }}
{{- end -}}

{{- define "vllm-tuner.selector" -}}
{{- .Values.pool.selector | default (dict "matchLabels" (dict "vllm-tuner.io/pool" (include "vllm-tuner.pool" .))) | toJson -}}
{{- end -}}

{{/* The pods' own ServiceAccount: the Role is bound to it; the tuner never changes a pod's ServiceAccount. */}}
{{- define "vllm-tuner.serviceAccount" -}}
{{- if .Values.serviceAccount.create -}}
{{ .Values.serviceAccount.name | default (include "vllm-tuner.fullname" .) }}
{{- else -}}
{{ required "serviceAccount.name: the ServiceAccount your vLLM pods run as (the Role is bound to it, and the tuner never replaces it), e.g. --set serviceAccount.name=vllm ('default' when the pod spec names none); or serviceAccount.create=true to make one and name it in your pod spec" .Values.serviceAccount.name }}
{{- end -}}
{{- end -}}

{{/* The agent's image: repository@digest, else repository:tag (default: the chart's appVersion); only when
image.repository is set (no placeholder image ever reaches a pod). */}}
{{- define "vllm-tuner.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* What `vllm-tuner inject` reads from the ConfigMap's vllm-tuner.io/agent annotation (JSON). */}}
{{- define "vllm-tuner.agent" -}}
{{- $agent := dict "imagePullPolicy" .Values.image.pullPolicy "resources" .Values.agent.resources "livenessProbe" .Values.agent.livenessProbe -}}
{{- if .Values.image.repository -}}
{{- $_ := set $agent "image" (include "vllm-tuner.image" .) -}}
{{- end -}}
{{- $agent | toJson -}}
{{- end -}}
