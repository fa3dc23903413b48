{{/* Address of the node's pool service: a unix socket in the shared host directory. */}}
{{- define "maru.poolAddress" -}}
unix://{{ .Values.pool.socketDir }}/{{ .Values.pool.name }}.sock
{{- end }}

{{/* Host paths shared by the pool and the workers: the region and the socket directory. */}}
{{- define "maru.volumes" -}}
- name: maru-region
  hostPath:
  {{- if eq .Values.pool.backend "shm" }}
    path: /dev/shm
    type: Directory
  {{- else if eq .Values.pool.backend "dax" }}
    path: {{ .Values.pool.path }}
    type: CharDevice
  {{- else }}
    path: {{ dir .Values.pool.path }}
    type: Directory
  {{- end }}
- name: maru-socket
  hostPath:
    path: {{ .Values.pool.socketDir }}
    type: DirectoryOrCreate
{{- end }}

{{- define "maru.volumeMounts" -}}
- name: maru-region
  {{- if eq .Values.pool.backend "shm" }}
  mountPath: /dev/shm
  {{- else if eq .Values.pool.backend "dax" }}
  mountPath: {{ .Values.pool.path }}
  {{- else }}
  mountPath: {{ dir .Values.pool.path }}
  {{- end }}
- name: maru-socket
  mountPath: {{ .Values.pool.socketDir }}
{{- end }}

{{- define "maru.labels" -}}
app.kubernetes.io/name: maru-dynamo
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}
