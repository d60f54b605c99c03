{{/*
Helpers. The chart keeps to the template subset documented in deploy/helm_render.py so that it
renders identically with Helm and with that renderer.
*/}}

{{- define "cosine.fullname" -}}
{{ .Release.Name | trunc 40 | trimSuffix "-" }}
{{- end }}

{{/* Labels; called with (dict "root" $ "component" NAME). */}}
{{- define "cosine.labels" -}}
app.kubernetes.io/name: cosine
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/component: {{ .component }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version }}
{{- end }}

{{- define "cosine.selectorLabels" -}}
app.kubernetes.io/name: cosine
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Image of a service; (dict "root" $ "service" NAME "cuda" BOOL). */}}
{{- define "cosine.image" -}}
{{- $img := .root.Values.image -}}
{{ printf "%s%s-%s%s:%s" $img.registry $img.prefix .service (ternary "-cuda" "" .cuda) $img.tag }}
{{- end }}

{{- define "cosine.redisSecret" -}}
{{ default (printf "%s-redis" (include "cosine.fullname" .)) .Values.redis.existingSecret }}
{{- end }}

{{- define "cosine.modelsClaim" -}}
{{ default (printf "%s-models" (include "cosine.fullname" .)) .Values.models.existingClaim }}
{{- end }}

{{/* Pod-level settings every CoSine pod shares; (dict "root" $). */}}
{{- define "cosine.podCommon" -}}
automountServiceAccountToken: false
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- end }}

{{- define "cosine.containerSecurity" -}}
securityContext:
  allowPrivilegeEscalation: false
  readOnlyRootFilesystem: true
  capabilities:
    drop: [ALL]
{{- end }}

{{/*
Environment of a CoSine container; (dict "root" $ "port" PORT). The pod advertises its own IP
(the router keeps per-pod KV state, so it must reach a pod, not a Service) and registers under
its pod name. COSINE_* settings come from the ConfigMaps (envFrom) and the Redis URL from the
Secret.
*/}}
{{- define "cosine.env" -}}
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: COSINE_MEMBER_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: COSINE_ADVERTISE_ADDRESS
  value: {{ printf "$(POD_IP):%d" (int .port) | quote }}
- name: COSINE_REDIS_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "cosine.redisSecret" .root }}
      key: redis-url
- name: HOME
  value: /tmp
- name: COSINE_METRICS_PORT
  value: {{ include "cosine.metricsPort" (dict "root" .root "component" .component) | quote }}
{{- with .root.Values.tls }}
{{- if .enabled }}
- name: COSINE_TLS_CERT
  value: {{ printf "%s/tls.crt" .mountPath | quote }}
- name: COSINE_TLS_KEY
  value: {{ printf "%s/tls.key" .mountPath | quote }}
- name: COSINE_TLS_CA
  value: {{ printf "%s/ca.crt" .mountPath | quote }}
- name: COSINE_TLS_SERVER_NAME
  value: {{ .serverName | quote }}
- name: COSINE_TLS_CLIENT_AUTH
  value: {{ ternary .gatewayClientAuth .mtls (eq $.component "gateway") | toString | quote }}
{{- end }}
{{- end }}
{{- end }}

{{/* The TLS Secret's mount and volume (nothing when TLS is off); called with the root context. */}}
{{- define "cosine.tlsVolumeMount" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  mountPath: {{ .Values.tls.mountPath }}
  readOnly: true
{{- end }}
{{- end }}

{{- define "cosine.tlsVolume" -}}
{{- if .Values.tls.enabled -}}
- name: tls
  secret:
    secretName: {{ required "tls.secretName is required when tls.enabled is true" .Values.tls.secretName }}
    defaultMode: 288  # 0440: the pod's group (fsGroup) reads the key, nobody else
{{- end }}
{{- end }}

{{/* The Prometheus /metrics port of a component, or -1 when metrics are off; (dict "root" . "component" NAME). */}}
{{- define "cosine.metricsPort" -}}
{{- if .root.Values.metrics.enabled -}}{{ index .root.Values.metrics.ports .component }}{{- else -}}-1{{- end -}}
{{- end }}

{{/* The metrics containerPort (nothing when metrics are off). */}}
{{- define "cosine.metricsContainerPort" -}}
{{- if .root.Values.metrics.enabled }}
- name: metrics
  containerPort: {{ index .root.Values.metrics.ports .component }}
{{- end }}
{{- end }}

{{/* Pod annotations for Prometheus' kubernetes_sd scrape convention (nothing when off). */}}
{{- define "cosine.metricsAnnotations" -}}
{{- if and .root.Values.metrics.enabled .root.Values.metrics.scrapeAnnotations }}
annotations:
  prometheus.io/scrape: "true"
  prometheus.io/port: {{ index .root.Values.metrics.ports .component | quote }}
  prometheus.io/path: /metrics
{{- end }}
{{- end }}

{{/*
Probes on the gRPC health protocol; (dict "port" PORT "service" NAME "startupSeconds" N "tls" BOOL).
Kubernetes' own gRPC probes cannot speak TLS: with TLS on, the probe runs the image's health check,
which reads the container's COSINE_TLS_* variables.
*/}}
{{- define "cosine.probeAction" -}}
{{- if .tls -}}
exec:
  command: ["python", "-m", "common.platform.healthcheck", {{ printf "127.0.0.1:%d" (int .port) | quote }}{{ if .service }}, "--service", {{ .service | quote }}{{ end }}, "--timeout", "4"]
timeoutSeconds: 5
{{- else -}}
grpc:
  port: {{ int .port }}
  {{- if .service }}
  service: {{ .service }}
  {{- end }}
{{- end }}
{{- end }}

{{- define "cosine.probes" -}}
startupProbe:
  {{- include "cosine.probeAction" . | nindent 2 }}
  periodSeconds: 5
  failureThreshold: {{ div (int .startupSeconds) 5 }}
readinessProbe:
  {{- include "cosine.probeAction" . | nindent 2 }}
  periodSeconds: 5
  failureThreshold: 2
livenessProbe:
  {{- include "cosine.probeAction" (dict "port" .port "service" "" "tls" .tls) | nindent 2 }}
  periodSeconds: 10
  {{- if not .tls }}
  timeoutSeconds: 3
  {{- end }}
  failureThreshold: 3
{{- end }}

{{- define "cosine.modelsVolume" -}}
- name: models
{{- if .Values.models.volume }}
  {{- toYaml .Values.models.volume | nindent 2 }}
{{- else }}
  persistentVolumeClaim:
    claimName: {{ include "cosine.modelsClaim" . }}
{{- end }}
{{- end }}

{{/* Waits for the zoo Job's output before a model server starts; (dict "root" $ "image" IMAGE). */}}
{{- define "cosine.waitForZoo" -}}
{{- if .root.Values.models.buildZoo.enabled -}}
initContainers:
  - name: wait-for-models
    image: {{ .image }}
    imagePullPolicy: {{ .root.Values.image.pullPolicy }}
    command: ["sh", "-c", {{ printf "until [ -f %s/zoo.json ]; do echo waiting for the model zoo; sleep 5; done" .root.Values.models.buildZoo.dir | quote }}]
    {{- include "cosine.containerSecurity" . | nindent 4 }}
    volumeMounts:
      - name: models
        mountPath: {{ .root.Values.models.mountPath }}
        readOnly: true
{{- end }}
{{- end }}

{{/* A NetworkPolicy ingress rule that lets scrapers (networkPolicy.metricsFrom; empty: anyone)
reach a component's /metrics port; nothing when metrics are off. (dict "root" . "component" NAME) */}}
{{- define "cosine.metricsIngress" -}}
{{- if .root.Values.metrics.enabled }}
- ports:
    - port: {{ index .root.Values.metrics.ports .component }}
      protocol: TCP
  {{- with .root.Values.networkPolicy.metricsFrom }}
  from:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}
{{- end }}
