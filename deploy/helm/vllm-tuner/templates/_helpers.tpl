{{- define "vllm-tuner.labels" -}}
app.kubernetes.io/name: vllm-tuner
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
vllm-tuner.io/pool: {{ .Values.pool.name | quote }}
{{- end -}}

{{- define "vllm-tuner.lease" -}}
vllm-tuner-{{ .Values.pool.name }}
{{- end -}}

{{- define "vllm-tuner.journal" -}}
vllm-tuner-journal-{{ .Values.pool.name }}
{{- end -}}

{{- define "vllm-tuner.pdb" -}}
{{ .Values.pdb.name | default .Values.pool.name }}
{{- end -}}
