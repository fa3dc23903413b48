{{/*
Shared pieces of the Maru chart. The pool (DaemonSet) and the workers (DGD components) must
agree on the region, the socket and the user, so each of those is written once, here.
*/}}

{{- define "maru.labels" -}}
app.kubernetes.io/name: maru-dynamo
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ .Chart.Name }}-{{ .Chart.Version }}
{{- end }}

{{/*
A value as one command-line word. Helm reads every number in the values as a float, which
`toString` writes as 1e+07 from ten million on; whole numbers are written as integers here.
*/}}
{{- define "maru.word" -}}
{{- if and (kindIs "float64" .) (eq (float64 (int64 .)) .) }}{{ int64 . }}{{ else }}{{ toString . }}{{ end }}
{{- end }}

{{- define "maru.poolSelectorLabels" -}}
app.kubernetes.io/name: maru-dynamo
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: pool
{{- end }}

{{/* Region path on the node: pool.path, or /dev/shm/maru-<name> for the shm backend. */}}
{{- define "maru.poolPath" -}}
{{- if .Values.pool.path }}{{ .Values.pool.path }}
{{- else if eq .Values.pool.backend "shm" }}/dev/shm/maru-{{ .Values.pool.name }}
{{- else }}{{ fail (printf "pool.path: missing; backend %q needs the device or file path on the nodes (/dev/daxX.Y, or a file on a DAX or hugetlbfs mount)" .Values.pool.backend) }}
{{- end }}
{{- end }}

{{/* Address of the node's pool service: a unix socket in the shared host directory. */}}
{{- define "maru.poolAddress" -}}
unix://{{ .Values.pool.socketDir }}/{{ .Values.pool.name }}.sock
{{- end }}

{{/* True ("true") when a device plugin, not a hostPath + privileged container, hands out the DAX device. */}}
{{- define "maru.daxByDevicePlugin" -}}
{{- if and (eq .Values.pool.backend "dax") (eq .Values.pool.daxAccess "devicePlugin") -}}
{{- if not .Values.pool.deviceResource }}{{ fail "pool.deviceResource: missing; pool.daxAccess=devicePlugin needs the extended resource name the device plugin advertises (e.g. example.com/cxl-dax)" }}{{ end -}}
true
{{- end }}
{{- end }}

{{/* Host paths shared by the pool and every worker: the region and the socket directory. */}}
{{- define "maru.volumes" -}}
{{- $path := include "maru.poolPath" . }}
{{- if ne (include "maru.daxByDevicePlugin" .) "true" }}
- name: maru-region
  hostPath:
  {{- if eq .Values.pool.backend "shm" }}
    path: /dev/shm
    type: Directory
  {{- else if eq .Values.pool.backend "dax" }}
    path: {{ $path }}
    type: CharDevice
  {{- else }}
    path: {{ dir $path }}
    type: Directory
  {{- end }}
{{- end }}
- name: maru-socket
  hostPath:
    path: {{ .Values.pool.socketDir }}
    type: DirectoryOrCreate
{{- end }}

{{- define "maru.volumeMounts" -}}
{{- $path := include "maru.poolPath" . }}
{{- if ne (include "maru.daxByDevicePlugin" .) "true" }}
- name: maru-region
  {{- if eq .Values.pool.backend "shm" }}
  mountPath: /dev/shm
  {{- else if eq .Values.pool.backend "dax" }}
  mountPath: {{ $path }}
  {{- else }}
  mountPath: {{ dir $path }}
  {{- end }}
{{- end }}
- name: maru-socket
  mountPath: {{ .Values.pool.socketDir }}
{{- end }}

{{/*
Security context of the pool and worker containers: both run as runAs.user/group (the region
and the socket are created 0600 by the pool), privileged only to reach a DAX device by hostPath.
*/}}
{{- define "maru.securityContext" -}}
runAsUser: {{ .Values.runAs.user }}
runAsGroup: {{ .Values.runAs.group }}
{{- if and (eq .Values.pool.backend "dax") (ne (include "maru.daxByDevicePlugin" .) "true") }}
privileged: true
{{- end }}
{{- end }}

{{/* Extended resources a pod needs for the region: the DAX device when a device plugin hands it out. */}}
{{- define "maru.regionResources" -}}
{{- if eq (include "maru.daxByDevicePlugin" .) "true" }}
{{ .Values.pool.deviceResource | quote }}: "1"
{{- end }}
{{- end }}

{{/* Node placement shared by the pool DaemonSet and the workers: both go to the pool nodes. */}}
{{- define "maru.placement" -}}
{{- with .Values.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/*
The worker list of the chosen graph, checked: agg has only `worker`s, disagg prefill + decode.
Each worker comes out with its tensorParallelSize (default 1) and gpus (default: one per rank);
gpus other than 0 (CPU nodes) must give every rank the same number of GPUs.
*/}}
{{- define "maru.checkedWorkers" -}}
{{- $graph := .Values.graph }}
{{- $workers := index .Values.workers $graph }}
{{- if not $workers }}{{ fail (printf "workers.%s: empty; list at least one worker for graph %q" $graph $graph) }}{{ end }}
{{- $types := list }}
{{- $names := list }}
{{- $checked := list }}
{{- range $w := $workers }}
{{- if has .name $names }}{{ fail (printf "workers.%s: duplicate worker name %q" $graph .name) }}{{ end }}
{{- if eq .name "frontend" }}{{ fail (printf "workers.%s: worker name %q is taken by the Frontend component (names are unique case-insensitively)" $graph .name) }}{{ end }}
{{- $names = append $names .name }}
{{- $types = append $types .type }}
{{- $tp := int64 (hasKey $w "tensorParallelSize" | ternary $w.tensorParallelSize 1) }}
{{- $gpus := int64 (hasKey $w "gpus" | ternary $w.gpus $tp) }}
{{- if and $gpus (mod $gpus $tp) }}{{ fail (printf "workers.%s: worker %q: gpus %d with tensorParallelSize %d; use a multiple of tensorParallelSize (one GPU per rank), or 0 for CPU nodes" $graph .name $gpus $tp) }}{{ end }}
{{- range .args }}
{{- $flag := regexReplaceAll "=.*" (toString .) "" }}
{{- if has $flag (list "--tensor-parallel-size" "-tp") }}{{ fail (printf "workers.%s: worker %q: args: %s is set by tensorParallelSize; use that instead" $graph $w.name $flag) }}{{ end }}
{{- end }}
{{- $checked = append $checked (merge (dict "tensorParallelSize" $tp "gpus" $gpus) (omit $w "tensorParallelSize" "gpus")) }}
{{- end }}
{{- if eq $graph "agg" }}
{{- if ne (uniq $types | join ",") "worker" }}{{ fail (printf "workers.agg: types %v: an agg graph has only type worker (use graph=disagg for prefill/decode)" (uniq $types)) }}{{ end }}
{{- else }}
{{- if or (has "worker" $types) (not (has "prefill" $types)) (not (has "decode" $types)) }}{{ fail (printf "workers.disagg: types %v: a disagg graph needs at least one prefill and one decode worker and no type worker" (uniq $types)) }}{{ end }}
{{- end }}
{{- toYaml $checked }}
{{- end }}

{{/* HOST:PORT of the pools' Mooncake master: mooncake.master, this release's master, or "" (no second tier). */}}
{{- define "maru.mooncakeMaster" -}}
{{- if .Values.mooncake.master }}{{ .Values.mooncake.master }}
{{- else if .Values.mooncake.enabled }}{{ .Release.Name }}-mooncake.{{ .Release.Namespace }}.svc:{{ include "maru.word" .Values.mooncake.rpcPort }}
{{- end }}
{{- end }}

{{/* The transfer engine's metadata URL: mooncake.metadata, this release's master's built-in server, or "" (the pool's default). */}}
{{- define "maru.mooncakeMetadata" -}}
{{- if .Values.mooncake.metadata }}{{ .Values.mooncake.metadata }}
{{- else if and .Values.mooncake.enabled (not .Values.mooncake.master) }}http://{{ .Release.Name }}-mooncake.{{ .Release.Namespace }}.svc:{{ include "maru.word" .Values.mooncake.metadataPort }}/metadata
{{- end }}
{{- end }}
