{{/* Names ----------------------------------------------------------------------------- */}}
{{- define "weightsync.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "weightsync.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Object names: trunc 40 above leaves room for "-trainer-worker-headless" style suffixes. */}}
{{- define "weightsync.trainer.name" -}}{{ include "weightsync.fullname" . }}-trainer{{- end -}}
{{- define "weightsync.worker.name" -}}{{ include "weightsync.fullname" . }}-trainer-worker{{- end -}}
{{- define "weightsync.headless.name" -}}{{ include "weightsync.fullname" . }}-trainer-headless{{- end -}}
{{- define "weightsync.rollout.name" -}}{{ include "weightsync.fullname" . }}-rollout{{- end -}}
{{- define "weightsync.colocated.name" -}}{{ include "weightsync.fullname" . }}-colocated{{- end -}}
{{- define "weightsync.config.name" -}}{{ include "weightsync.fullname" . }}-config{{- end -}}

{{- define "weightsync.dataClaimName" -}}
{{- default (printf "%s-data" (include "weightsync.fullname" .)) .Values.persistence.existingClaim -}}
{{- end -}}

{{- define "weightsync.secretName" -}}
{{- default (printf "%s-token" (include "weightsync.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* The token of the chart-created Secret: auth.token, else the one already in the cluster (kept
     across upgrades), else a random one. Computed once per render and kept on the root context, so the
     Secret and the pods' checksum/token annotation see the same value. */}}
{{- define "weightsync.token" -}}
{{- if not (hasKey . "weightsyncToken") -}}
{{- $token := .Values.auth.token -}}
{{- if not $token -}}
{{- /* `lookup` is empty under `helm template`: a fresh token each render there. */ -}}
{{- $old := lookup "v1" "Secret" .Release.Namespace (include "weightsync.secretName" .) -}}
{{- if and $old $old.data (hasKey $old.data .Values.auth.secretKey) -}}
{{- $token = index $old.data .Values.auth.secretKey | b64dec -}}
{{- else -}}
{{- $token = randAlphaNum 48 -}}
{{- end -}}
{{- end -}}
{{- $_ := set . "weightsyncToken" $token -}}
{{- end -}}
{{- .weightsyncToken -}}
{{- end -}}

{{/* Pod annotations that restart the pods when what they read at start changes: the ConfigMap,
     and the token when the chart owns its Secret (a Secret of your own: `kubectl rollout restart`). */}}
{{- define "weightsync.podChecksums" -}}
checksum/config: {{ include (print .Template.BasePath "/configmap.yaml") . | sha256sum }}
{{- if and .Values.auth.enabled (not .Values.auth.existingSecret) }}
checksum/token: {{ include "weightsync.token" . | sha256sum }}
{{- end }}
{{- end -}}

{{- define "weightsync.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "weightsync.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* Labels: call with (dict "ctx" $ "component" "trainer") ------------------------------- */}}
{{- define "weightsync.selectorLabels" -}}
app.kubernetes.io/name: {{ include "weightsync.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
{{- with .component }}
app.kubernetes.io/component: {{ . }}
{{- end }}
{{- end -}}

{{- define "weightsync.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .ctx.Chart.Name .ctx.Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{ include "weightsync.selectorLabels" . }}
app.kubernetes.io/version: {{ .ctx.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .ctx.Release.Service }}
app.kubernetes.io/part-of: weightsync
{{- end -}}

{{/* Images: repository:tag[@digest] ------------------------------------------------------ */}}
{{- define "weightsync.image" -}}
{{- $tag := default .ctx.Chart.AppVersion .image.tag -}}
{{- if .image.digest -}}
{{- printf "%s:%s@%s" .image.repository $tag .image.digest -}}
{{- else -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* Paths inside the pods. */}}
{{- define "weightsync.configDir" -}}/etc/weightsync{{- end -}}
{{- define "weightsync.tokenDir" -}}/var/run/secrets/weightsync{{- end -}}

{{/* Service config files: YAML keys are TrainerConfig / RolloutConfig field names. ---------- */}}
{{- define "weightsync.trainerConfig" -}}
{{- $v := .Values -}}
{{- $managed := dict "grpc_address" (printf "0.0.0.0:%d" (int $v.trainer.ports.grpc)) "http_address" (printf "0.0.0.0:%d" (int $v.trainer.ports.http)) -}}
{{- if eq $v.mode "colocated" -}}
{{- $_ := set $managed "transport" "ipc" -}}
{{- end -}}
{{- if $v.auth.enabled -}}
{{- $_ := set $managed "auth_token_file" (printf "%s/%s" (include "weightsync.tokenDir" .) $v.auth.secretKey) -}}
{{- else -}}
{{- /* Pods listen on 0.0.0.0: without a token the services refuse to start unless told this is on purpose. */ -}}
{{- $_ := set $managed "insecure" true -}}
{{- end -}}
{{- $cfg := deepCopy $v.trainer.config -}}
{{- if $v.persistence.enabled -}}
{{- /* Defaults, not overrides: a value set under trainer.config wins (checked to be on the volume). */ -}}
{{- $cfg = mustMergeOverwrite (dict "data_root" $v.persistence.mountPath "checkpoint_dir" (printf "%s/checkpoints" $v.persistence.mountPath)) $cfg -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite $cfg $managed) -}}
{{- end -}}

{{- define "weightsync.rolloutConfig" -}}
{{- $v := .Values -}}
{{- $managed := dict "grpc_address" (printf "0.0.0.0:%d" (int $v.rollout.ports.grpc)) "http_address" (printf "0.0.0.0:%d" (int $v.rollout.ports.http)) "data_address" (printf "0.0.0.0:%d" (int $v.rollout.ports.data)) -}}
{{- if eq $v.mode "colocated" -}}
{{- /* Same network namespace: the trainer dials the rollout over loopback. */ -}}
{{- $_ := set $managed "trainer_address" (printf "127.0.0.1:%d" (int $v.trainer.ports.grpc)) -}}
{{- $_ := set $managed "advertise_address" (printf "127.0.0.1:%d" (int $v.rollout.ports.grpc)) -}}
{{- $_ := set $managed "advertise_data_host" "127.0.0.1" -}}
{{- else if not $v.trainer.enabled -}}
{{- /* No trainer in this release: an external publisher (weightsync.publisher.Publisher). */ -}}
{{- $_ := set $managed "trainer_address" $v.rollout.trainerAddress -}}
{{- else -}}
{{- $_ := set $managed "trainer_address" (printf "%s.%s.svc:%d" (include "weightsync.trainer.name" .) .Release.Namespace (int $v.trainer.ports.grpc)) -}}
{{- end -}}
{{- if $v.auth.enabled -}}
{{- $_ := set $managed "auth_token_file" (printf "%s/%s" (include "weightsync.tokenDir" .) $v.auth.secretKey) -}}
{{- else -}}
{{- /* Pods listen on 0.0.0.0: without a token the services refuse to start unless told this is on purpose. */ -}}
{{- $_ := set $managed "insecure" true -}}
{{- end -}}
{{- toYaml (mustMergeOverwrite (deepCopy $v.rollout.config) $managed) -}}
{{- end -}}

{{/* Render-time checks the schema cannot express. -------------------------------------- */}}
{{- define "weightsync.validate" -}}
{{- $v := .Values -}}
{{- if not $v.trainer.enabled -}}
{{- include "weightsync.validateExternal" . -}}
{{- else -}}
{{- include "weightsync.validateTrainer" . -}}
{{- end -}}
{{- if $v.rollout.multiNode.enabled -}}
{{- fail "rollout.multiNode.enabled: multi-node rollout engines are not implemented yet (see docs/operations.md, 'Scaling rollouts')" -}}
{{- end -}}
{{- if and $v.auth.enabled (not $v.auth.existingSecret) $v.auth.token (lt (len $v.auth.token) 16) -}}
{{- fail "auth.token must be at least 16 characters (or leave it empty to generate one)" -}}
{{- end -}}
{{- end -}}

{{/* trainer.enabled=false: rollouts only, following an external publisher. */}}
{{- define "weightsync.validateExternal" -}}
{{- $v := .Values -}}
{{- if ne $v.mode "disaggregated" -}}
{{- fail "trainer.enabled=false deploys rollouts for an external publisher: set mode=disaggregated (colocated runs the trainer in the rollout's pod)" -}}
{{- end -}}
{{- if not (regexMatch "^[^\\s:/]+:[0-9]+$" $v.rollout.trainerAddress) -}}
{{- fail (printf "rollout.trainerAddress=%q: with trainer.enabled=false set it to the external publisher's gRPC host:port (e.g. trainer.ml.svc:50051)" $v.rollout.trainerAddress) -}}
{{- end -}}
{{- if and $v.networkPolicy.enabled (not $v.networkPolicy.trainerFrom) -}}
{{- fail "networkPolicy.trainerFrom is empty: with trainer.enabled=false list the external publisher's pods (NetworkPolicyPeers: every rank that streams reaches the rollouts), or set networkPolicy.enabled=false" -}}
{{- end -}}
{{- if $v.persistence.enabled -}}
{{- fail "persistence holds the trainer's checkpoints: with trainer.enabled=false there is none; set persistence.enabled=false" -}}
{{- end -}}
{{- end -}}

{{/* This release's trainer. */}}
{{- define "weightsync.validateTrainer" -}}
{{- $v := .Values -}}
{{- if $v.rollout.trainerAddress -}}
{{- fail (printf "rollout.trainerAddress=%s points the rollouts at an external publisher: set trainer.enabled=false too (or leave it empty to follow this release's trainer)" $v.rollout.trainerAddress) -}}
{{- end -}}
{{- $world := mul $v.trainer.nnodes (max 1 $v.trainer.nprocPerNode) -}}
{{- $tp := int (default 1 $v.trainer.config.tp) -}}
{{- $pp := int (default 1 $v.trainer.config.pp) -}}
{{- if and (eq (default "megatron" $v.trainer.config.backend) "megatron") (ne (int $world) (mul $tp $pp)) -}}
{{- fail (printf "trainer: tp (%d) * pp (%d) = %d must equal the torchrun world size nnodes (%d) * nprocPerNode (%d) = %d" $tp $pp (mul $tp $pp) (int $v.trainer.nnodes) (int $v.trainer.nprocPerNode) (int $world)) -}}
{{- end -}}
{{- if and (eq (default "megatron" $v.trainer.config.backend) "hf") (gt (int $world) 1) -}}
{{- fail "trainer: backend=hf runs one process: set nnodes=1 and nprocPerNode<=1, or use backend=megatron" -}}
{{- end -}}
{{- $ed := default "float32" $v.trainer.config.export_dtype -}}
{{- $rd := default "float32" $v.rollout.config.dtype -}}
{{- if and (ne $ed $rd) (ne $ed "fp8-block") -}}
{{- fail (printf "trainer.config.export_dtype (%s) must equal rollout.config.dtype (%s): the bus carries the engine's dtype (or use fp8-block, which any engine dtype accepts)" $ed $rd) -}}
{{- end -}}
{{- if eq $v.mode "colocated" -}}
{{- if ne (int $v.trainer.nnodes) 1 -}}
{{- fail "mode=colocated runs one pod: trainer.nnodes must be 1" -}}
{{- end -}}
{{- if gt (int $v.trainer.nprocPerNode) (int $v.colocated.gpus) -}}
{{- fail "mode=colocated: trainer.nprocPerNode must not exceed colocated.gpus" -}}
{{- end -}}
{{- else if eq (default "" $v.trainer.config.transport) "ipc" -}}
{{- fail "trainer.config.transport=ipc needs trainer and rollout on one GPU: use mode=colocated" -}}
{{- end -}}
{{- if $v.persistence.enabled -}}
{{- $root := trimSuffix "/" $v.persistence.mountPath -}}
{{- range $key := list "data_root" "checkpoint_dir" -}}
{{- $path := index $v.trainer.config $key | default "" -}}
{{- if and $path (ne $path $root) (not (hasPrefix (printf "%s/" $root) $path)) -}}
{{- fail (printf "trainer.config.%s=%s is outside persistence.mountPath (%s): it would not survive a restart; put it under %s or leave it unset (default: %s)" $key $path $root $root (ternary $root (printf "%s/checkpoints" $root) (eq $key "data_root"))) -}}
{{- end -}}
{{- end -}}
{{- if and (gt (int $v.trainer.nnodes) 1) (not $v.persistence.existingClaim) (not (has "ReadWriteMany" $v.persistence.accessModes)) -}}
{{- fail (printf "persistence: trainer.nnodes=%d pods write checkpoints to one directory: set persistence.accessModes to [ReadWriteMany] (a class that supports it, e.g. NFS/CephFS) or persistence.existingClaim" (int $v.trainer.nnodes)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
