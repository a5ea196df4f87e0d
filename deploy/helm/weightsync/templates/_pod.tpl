{{/*
Pod building blocks shared by the trainer StatefulSets, the rollout Deployment and the colocated
StatefulSet. Each takes (dict "ctx" $ ...) so that the same container renders in either mode.
*/}}

{{- define "weightsync.worldSize" -}}
{{- mul .Values.trainer.nnodes (max 1 .Values.trainer.nprocPerNode) -}}
{{- end -}}

{{/* torchrun static rendezvous: node rank 0 runs on <trainer>-0, so global rank 0 (the one that
     serves gRPC/HTTP) is always that pod and the trainer Service can select it by name. */}}
{{- define "weightsync.masterAddr" -}}
{{- printf "%s-0.%s.%s.svc" (include "weightsync.trainer.name" .) (include "weightsync.headless.name" .) .Release.Namespace -}}
{{- end -}}

{{- define "weightsync.trainerArgs" -}}
{{- $ctx := .ctx -}}
{{- $cfg := printf "%s/trainer.yaml" (include "weightsync.configDir" $ctx) -}}
{{- if and (eq .role "leader") (eq (include "weightsync.worldSize" $ctx) "1") -}}
- trainer-svc
- serve
- --config
- {{ $cfg }}
{{- else if eq .role "worker" -}}
- /bin/sh
- -c
- >-
  exec torchrun --nnodes {{ $ctx.Values.trainer.nnodes }} --nproc-per-node {{ max 1 $ctx.Values.trainer.nprocPerNode }}
  --node-rank "$((POD_INDEX + 1))" --rdzv-backend static
  --master-addr {{ include "weightsync.masterAddr" $ctx }} --master-port {{ $ctx.Values.trainer.rendezvous.port }}
  -m trainer_svc serve --config {{ $cfg }}
{{- else -}}
- torchrun
- --nnodes
- {{ $ctx.Values.trainer.nnodes | quote }}
- --nproc-per-node
- {{ max 1 $ctx.Values.trainer.nprocPerNode | quote }}
- --node-rank
- "0"
- --rdzv-backend
- static
- --master-addr
- {{ if eq $ctx.Values.mode "colocated" }}127.0.0.1{{ else }}{{ include "weightsync.masterAddr" $ctx }}{{ end }}
- --master-port
- {{ $ctx.Values.trainer.rendezvous.port | quote }}
- -m
- trainer_svc
- serve
- --config
- {{ $cfg }}
{{- end -}}
{{- end -}}

{{- define "weightsync.downwardEnv" -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
{{- end -}}

{{- define "weightsync.probes" -}}
{{- $p := .probes -}}
startupProbe:
  grpc:
    port: {{ .grpcPort }}
    service: {{ .grpcService | quote }}
  periodSeconds: {{ $p.startup.periodSeconds | default 10 }}
  timeoutSeconds: {{ $p.startup.timeoutSeconds | default 5 }}
  failureThreshold: {{ $p.startup.failureThreshold | default 90 }}
  {{- with $p.startup.initialDelaySeconds }}
  initialDelaySeconds: {{ . }}
  {{- end }}
livenessProbe:
  httpGet:
    path: /healthz
    port: http
  periodSeconds: {{ $p.liveness.periodSeconds | default 15 }}
  timeoutSeconds: {{ $p.liveness.timeoutSeconds | default 5 }}
  failureThreshold: {{ $p.liveness.failureThreshold | default 4 }}
  {{- with $p.liveness.initialDelaySeconds }}
  initialDelaySeconds: {{ . }}
  {{- end }}
readinessProbe:
  httpGet:
    path: /readyz
    port: http
  periodSeconds: {{ $p.readiness.periodSeconds | default 10 }}
  timeoutSeconds: {{ $p.readiness.timeoutSeconds | default 5 }}
  failureThreshold: {{ $p.readiness.failureThreshold | default 3 }}
  {{- with $p.readiness.initialDelaySeconds }}
  initialDelaySeconds: {{ . }}
  {{- end }}
{{- end -}}

{{/* Resources: user requests/limits plus the GPUs (device plugin) or the shared DRA claim. */}}
{{- define "weightsync.resources" -}}
{{- $ctx := .ctx -}}
{{- $res := deepCopy (default (dict) .resources) -}}
{{- if eq $ctx.Values.mode "colocated" -}}
{{- $_ := set $res "claims" (list (dict "name" "gpus")) -}}
{{- else if gt (int .gpus) 0 -}}
{{- $limits := default (dict) $res.limits -}}
{{- $_ := set $limits $ctx.Values.gpuResourceName (int .gpus) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{- define "weightsync.volumeMounts" -}}
- name: config
  mountPath: {{ include "weightsync.configDir" .ctx }}
  readOnly: true
{{- if .ctx.Values.auth.enabled }}
- name: token
  mountPath: {{ include "weightsync.tokenDir" .ctx }}
  readOnly: true
{{- end }}
- name: dshm
  mountPath: /dev/shm
- name: tmp
  mountPath: /tmp
- name: {{ .component }}-home
  mountPath: /home/ws
{{- if and (eq .component "trainer") .ctx.Values.persistence.enabled }}
- name: data
  mountPath: {{ .ctx.Values.persistence.mountPath }}
{{- end }}
{{- if .ctx.Values.model.volume }}
- name: model
  mountPath: {{ .ctx.Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "weightsync.volumes" -}}
{{- $ctx := .ctx -}}
- name: config
  configMap:
    name: {{ include "weightsync.config.name" $ctx }}
{{- if $ctx.Values.auth.enabled }}
- name: token
  secret:
    secretName: {{ include "weightsync.secretName" $ctx }}
    defaultMode: 0440
    items:
      - key: {{ $ctx.Values.auth.secretKey }}
        path: {{ $ctx.Values.auth.secretKey }}
{{- end }}
- name: dshm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .shmSize }}
- name: tmp
  emptyDir: {}
{{- range .homes }}
- name: {{ . }}-home
  emptyDir: {}
{{- end }}
{{- if and (has "trainer" .homes) $ctx.Values.persistence.enabled }}
- name: data
  persistentVolumeClaim:
    claimName: {{ include "weightsync.dataClaimName" $ctx }}
{{- end }}
{{- with $ctx.Values.model.volume }}
- name: model
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The trainer container; role = leader (global rank 0, serves gRPC/HTTP) | worker. */}}
{{- define "weightsync.trainerContainer" -}}
{{- $ctx := .ctx -}}
{{- $t := $ctx.Values.trainer -}}
- name: trainer
  image: {{ include "weightsync.image" (dict "ctx" $ctx "image" $ctx.Values.image.trainer) }}
  imagePullPolicy: {{ $ctx.Values.image.trainer.pullPolicy }}
  command:
    {{- include "weightsync.trainerArgs" . | nindent 4 }}
  env:
    {{- include "weightsync.downwardEnv" $ctx | nindent 4 }}
    {{- if eq .role "worker" }}
    - name: POD_INDEX
      valueFrom:
        fieldRef:
          fieldPath: metadata.labels['apps.kubernetes.io/pod-index']
    {{- end }}
    {{- with $t.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    {{- if ne .role "worker" }}
    - name: grpc
      containerPort: {{ $t.ports.grpc }}
      protocol: TCP
    - name: http
      containerPort: {{ $t.ports.http }}
      protocol: TCP
    {{- end }}
    - name: rendezvous
      containerPort: {{ $t.rendezvous.port }}
      protocol: TCP
  {{- if ne .role "worker" }}
  {{- include "weightsync.probes" (dict "probes" $t.probes "grpcPort" $t.ports.grpc "grpcService" "weightsync.v1.Trainer") | nindent 2 }}
  {{- end }}
  resources:
    {{- include "weightsync.resources" (dict "ctx" $ctx "resources" $t.resources "gpus" $t.nprocPerNode) | nindent 4 }}
  securityContext:
    {{- toYaml $ctx.Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "weightsync.volumeMounts" (dict "ctx" $ctx "component" "trainer") | nindent 4 }}
{{- end -}}

{{- define "weightsync.rolloutContainer" -}}
{{- $ctx := .ctx -}}
{{- $r := $ctx.Values.rollout -}}
- name: rollout
  image: {{ include "weightsync.image" (dict "ctx" $ctx "image" $ctx.Values.image.rollout) }}
  imagePullPolicy: {{ $ctx.Values.image.rollout.pullPolicy }}
  command:
    - rollout-svc
    - serve
    - --config
    - {{ include "weightsync.configDir" $ctx }}/rollout.yaml
  env:
    {{- include "weightsync.downwardEnv" $ctx | nindent 4 }}
    # Per-pod settings cannot live in the shared ConfigMap: env (WS_ROLLOUT_*) sits above the file.
    - name: WS_ROLLOUT_ROLLOUT_ID
      value: "$(POD_NAME)"
    {{- if and $ctx.Values.auth.enabled $ctx.Values.auth.generationKeySecret }}
    - name: WS_ROLLOUT_GENERATION_TOKEN
      valueFrom:
        secretKeyRef:
          name: {{ $ctx.Values.auth.generationKeySecret }}
          key: {{ $ctx.Values.auth.generationKeySecretKey }}
    {{- end }}
    {{- if ne $ctx.Values.mode "colocated" }}
    - name: WS_ROLLOUT_ADVERTISE_ADDRESS
      value: "$(POD_IP):{{ $r.ports.grpc }}"
    - name: WS_ROLLOUT_ADVERTISE_DATA_HOST
      value: "$(POD_IP)"
    {{- end }}
    {{- with $r.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  ports:
    - name: {{ if eq $ctx.Values.mode "colocated" }}rollout-grpc{{ else }}grpc{{ end }}
      containerPort: {{ $r.ports.grpc }}
      protocol: TCP
    - name: {{ if eq $ctx.Values.mode "colocated" }}rollout-http{{ else }}http{{ end }}
      containerPort: {{ $r.ports.http }}
      protocol: TCP
    - name: data
      containerPort: {{ $r.ports.data }}
      protocol: TCP
  {{- $probes := include "weightsync.probes" (dict "probes" $r.probes "grpcPort" $r.ports.grpc "grpcService" "weightsync.v1.Rollout") }}
  {{- if eq $ctx.Values.mode "colocated" }}
  {{- $probes = $probes | replace "port: http" (printf "port: rollout-http") }}
  {{- end }}
  {{- $probes | nindent 2 }}
  resources:
    {{- include "weightsync.resources" (dict "ctx" $ctx "resources" $r.resources "gpus" $r.gpus) | nindent 4 }}
  securityContext:
    {{- toYaml $ctx.Values.securityContext | nindent 4 }}
  volumeMounts:
    {{- include "weightsync.volumeMounts" (dict "ctx" $ctx "component" "rollout") | nindent 4 }}
{{- end -}}

{{- define "weightsync.podCommon" -}}
serviceAccountName: {{ include "weightsync.serviceAccountName" . }}
automountServiceAccountToken: false
securityContext:
  {{- toYaml .Values.podSecurityContext | nindent 2 }}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}
