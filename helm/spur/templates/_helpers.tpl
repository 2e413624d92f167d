{{/*
Names and labels.
*/}}
{{- define "spur.name" -}}
{{- .Values.nameOverride | default .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}

{{- define "spur.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "spur.selectorLabels" -}}
app.kubernetes.io/name: {{ include "spur.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "spur.labels" -}}
{{ include "spur.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/*
The spur config tree as YAML: `spurConfigYaml` when set, else `spur`.
*/}}
{{- define "spur.configYaml" -}}
{{- if .Values.spurConfigYaml -}}
{{- .Values.spurConfigYaml -}}
{{- else -}}
{{- toYaml .Values.spur -}}
{{- end -}}
{{- end -}}

{{/*
The config tree as data; fails with the parser's message when spurConfigYaml is not YAML.
*/}}
{{- define "spur.configData" -}}
{{- $cfg := include "spur.configYaml" . | fromYaml -}}
{{- if hasKey $cfg "Error" -}}
{{- fail (printf "spurConfigYaml is not a YAML mapping: %s" $cfg.Error) -}}
{{- end -}}
{{- if not $cfg.lanes -}}
{{- fail "the spur config has no lanes: give at least one under spur.lanes (or in spurConfigYaml)" -}}
{{- end -}}
{{- toYaml $cfg -}}
{{- end -}}

{{/*
One worker group per lane plus one for the spare, derived from the config with
configs/schema.py's defaults (tests/helm check that they agree):
  name, kind (lane | spare), deployment, device, tp, gpus (per pod), replicas,
  minReplicas, maxReplicas, autoscaling (bool), autoscalingSpec (the lane's autoscaling
  tree), drain (drain_timeout_s), drainSeconds
  (rounded up), rayResources, maxOngoing, maxQueued, override (groups.<name>)
Fails, naming the fix, on what JSON Schema cannot check: duplicate lane names, a spare
serving an unknown lane, a group with fewer GPUs than tensor_parallel_size, autoscaling
bounds the wrong way round.
*/}}
{{- define "spur.groups" -}}
{{- $cfg := include "spur.configData" . | fromYaml -}}
{{- $groups := list -}}
{{- $laneNames := list -}}
{{- $sources := list -}}
{{- range $i, $lane := $cfg.lanes -}}
{{- if has $lane.name $laneNames -}}
{{- fail (printf "spur.lanes[%d].name: %q is already the name of another lane; lane names must be unique" $i $lane.name) -}}
{{- end -}}
{{- $laneNames = append $laneNames $lane.name -}}
{{- $sources = append $sources (dict "kind" "lane" "path" (printf "spur.lanes[%d]" $i) "spec" $lane) -}}
{{- end -}}
{{- with $cfg.spare -}}
{{- $spare := . -}}
{{- range $j, $served := ($spare.serves_lanes | default list) -}}
{{- if not (has $served $laneNames) -}}
{{- fail (printf "spur.spare.serves_lanes[%d]: no lane is named %q (lanes: %s): name one of the lanes" $j $served (join ", " $laneNames)) -}}
{{- end -}}
{{- end -}}
{{- $sources = append $sources (dict "kind" "spare" "path" "spur.spare" "spec" (merge (dict "name" ($spare.name | default "spare")) $spare)) -}}
{{- end -}}
{{- range $sources -}}
{{- $spec := .spec -}}
{{- $path := .path -}}
{{- $engine := $spec.engine | default dict -}}
{{- $par := $engine.parallelism | default dict -}}
{{- $tp := int ($par.tensor_parallel_size | default 1) -}}
{{- $device := $par.device | default "auto" -}}
{{- $replicas := 1 -}}
{{- $min := 1 -}}
{{- $max := 1 -}}
{{- $autoscaling := false -}}
{{- if eq .kind "lane" -}}
{{- $replicas = int ($spec.replicas | default 1) -}}
{{- $min = $replicas -}}
{{- $max = $replicas -}}
{{- with $spec.autoscaling -}}
{{- $autoscaling = true -}}
{{- $min = int (.min_replicas | default 1) -}}
{{- $max = int (.max_replicas | default 0) -}}
{{- $replicas = $min -}}
{{- if lt $max $min -}}
{{- fail (printf "%s.autoscaling: max_replicas (%d) is below min_replicas (%d): raise max_replicas or lower min_replicas" $path $max $min) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $need := 0 -}}
{{- if eq $device "cuda" -}}
{{- $need = $tp -}}
{{- end -}}
{{- $override := get ($.Values.groups | default dict) $spec.name | default dict -}}
{{- $gpus := $need -}}
{{- if hasKey $override "gpus" -}}
{{- $gpus = int $override.gpus -}}
{{- end -}}
{{- if lt $gpus $need -}}
{{- fail (printf "groups.%s.gpus is %d but %s.engine.parallelism.tensor_parallel_size is %d on cuda: each pod holds one whole replica, so give the group at least %d GPUs (or lower tensor_parallel_size)" $spec.name $gpus $path $tp $tp) -}}
{{- end -}}
{{- $drain := 30.0 -}}
{{- if and (hasKey $spec "drain_timeout_s") (not (kindIs "invalid" $spec.drain_timeout_s)) -}}
{{- $drain = float64 $spec.drain_timeout_s -}}
{{- end -}}
{{- $rayResources := dict -}}
{{- range $key, $amount := ($spec.resources | default dict) -}}
{{- $_ := set $rayResources $key (toString $amount) -}}
{{- end -}}
{{- $groups = append $groups (dict "name" $spec.name "kind" .kind "deployment" (printf "engine-%s" $spec.name) "device" $device "tp" $tp "gpus" $gpus "replicas" $replicas "minReplicas" $min "maxReplicas" $max "autoscaling" $autoscaling "autoscalingSpec" ($spec.autoscaling | default dict) "drain" $drain "drainSeconds" (int (ceil $drain)) "rayResources" $rayResources "maxOngoing" (int ($spec.max_ongoing_requests | default 256)) "maxQueued" (int (ternary $spec.max_queued_requests 512 (hasKey $spec "max_queued_requests"))) "override" $override) -}}
{{- end -}}
{{- $names := list -}}
{{- range $groups -}}
{{- $names = append $names .name -}}
{{- end -}}
{{- range $key, $_ := ($.Values.groups | default dict) -}}
{{- if not (has $key $names) -}}
{{- fail (printf "groups.%s: no lane or spare is named %q (groups: %s): fix the name" $key $key (join ", " $names)) -}}
{{- end -}}
{{- end -}}
{{- toYaml (dict "groups" $groups) -}}
{{- end -}}

{{/*
Environment of every Ray container.
*/}}
{{- define "spur.env" -}}
- name: RAY_SERVE_PROXY_USE_GRPC
  value: "1"
- name: HF_HUB_OFFLINE
  value: "1"
{{- /* In every pod: an ingress replica reads the keys wherever Ray places it. */ -}}
{{- with .Values.apiKeys.secretName }}
- name: SPUR_API_KEYS
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.apiKeys.key }}
{{- end }}
{{- with .Values.env }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/*
Volumes of a pod: Ray's object store in memory (/dev/shm: a container's default 64 MiB
would push it to disk) and the model storage of its group, (dict "storage" S).
*/}}
{{- define "spur.volumes" -}}
{{- $s := .storage -}}
- name: shm
  emptyDir:
    medium: Memory
{{- if eq $s.type "pvc" }}
- name: models
  persistentVolumeClaim:
    claimName: {{ required "modelStorage.claimName is required with modelStorage.type pvc: name the PersistentVolumeClaim holding the models" $s.claimName }}
    readOnly: true
{{- else if eq $s.type "hostPath" }}
- name: models
  hostPath:
    path: {{ required "modelStorage.hostPath is required with modelStorage.type hostPath: give the models' folder on the nodes" $s.hostPath }}
    type: Directory
{{- end }}
{{- end -}}

{{- define "spur.volumeMounts" -}}
- name: shm
  mountPath: /dev/shm
{{- if ne .type "none" }}
- name: models
  mountPath: {{ .mountPath | default "/models" }}
  readOnly: true
{{- end }}
{{- end -}}

{{/*
preStop of a pod that holds engine replicas: drain the Ray node (Serve starts
replacements elsewhere and stops the node's replicas gracefully, each within its
drain_timeout_s), then wait until no replica process is left or the deadline passes.
Replica processes are titled "ray::" + "ServeReplica:..."; the script greps for
"[S]erveReplica:", which its own command line (in /proc too) does not match, so it
must not spell the title anywhere else, comments included.
*/}}
{{- define "spur.preStop" -}}
preStop:
  exec:
    command:
      - /bin/bash
      - -c
      - |
        ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION --reason-message "pod $HOSTNAME terminating" --deadline-remaining-seconds {{ .seconds }} || true
        end=$((SECONDS + {{ .seconds }}))
        while [ "$SECONDS" -lt "$end" ] && grep -qs "[S]erveReplica:" /proc/[0-9]*/cmdline; do sleep 1; done
{{- end -}}
