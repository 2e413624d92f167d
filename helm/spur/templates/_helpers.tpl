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
  tree), drain (drain_timeout_s), drainSeconds (rounded up), rayResources, maxOngoing,
  maxQueued, override (groups.<name>), storage (modelStorage with the group's
  overrides)
Fails, naming the fix, on what JSON Schema cannot check: a name that is not a DNS-1123
label, duplicate lane names, a spare named like a lane or serving an unknown lane, a
group with fewer GPUs than tensor_parallel_size or fewer CPUs than one replica
reserves, autoscaling bounds the wrong way round.
*/}}
{{- define "spur.groups" -}}
{{- $cfg := include "spur.configData" . | fromYaml -}}
{{- $groups := list -}}
{{- $laneNames := list -}}
{{- $sources := list -}}
{{- range $i, $lane := $cfg.lanes -}}
{{- $path := printf "spur.lanes[%d]" $i -}}
{{- include "spur.checkName" (dict "name" $lane.name "path" $path "kind" "lane") -}}
{{- if has $lane.name $laneNames -}}
{{- fail (printf "%s.name: %q is already the name of another lane; lane names must be unique" $path $lane.name) -}}
{{- end -}}
{{- $laneNames = append $laneNames $lane.name -}}
{{- $sources = append $sources (dict "kind" "lane" "path" $path "spec" $lane) -}}
{{- end -}}
{{- with $cfg.spare -}}
{{- $spare := merge (dict "name" (.name | default "spare")) . -}}
{{- include "spur.checkName" (dict "name" $spare.name "path" "spur.spare" "kind" "spare") -}}
{{- if has $spare.name $laneNames -}}
{{- fail (printf "spur.spare.name: %q is also a lane's name; give the spare its own name (it names its own worker group, Serve deployment and PodDisruptionBudget)" $spare.name) -}}
{{- end -}}
{{- range $j, $served := ($spare.serves_lanes | default list) -}}
{{- if not (has $served $laneNames) -}}
{{- fail (printf "spur.spare.serves_lanes[%d]: no lane is named %q (lanes: %s): name one of the lanes" $j $served (join ", " $laneNames)) -}}
{{- end -}}
{{- end -}}
{{- $sources = append $sources (dict "kind" "spare" "path" "spur.spare" "spec" $spare) -}}
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
{{- include "spur.checkCpus" (dict "spec" $spec "path" $path "tp" $tp "device" $device "override" $override "workers" $.Values.workers) -}}
{{- $drain := 30.0 -}}
{{- if and (hasKey $spec "drain_timeout_s") (not (kindIs "invalid" $spec.drain_timeout_s)) -}}
{{- $drain = float64 $spec.drain_timeout_s -}}
{{- end -}}
{{- $rayResources := dict -}}
{{- range $key, $amount := ($spec.resources | default dict) -}}
{{- $_ := set $rayResources $key (toString $amount) -}}
{{- end -}}
{{- /* a group's modelStorage overrides the keys it sets, the rest is the chart's */ -}}
{{- $storage := merge (deepCopy ($override.modelStorage | default dict)) (deepCopy $.Values.modelStorage) -}}
{{- $groups = append $groups (dict "name" $spec.name "kind" .kind "deployment" (printf "engine-%s" $spec.name) "device" $device "tp" $tp "gpus" $gpus "replicas" $replicas "minReplicas" $min "maxReplicas" $max "autoscaling" $autoscaling "autoscalingSpec" ($spec.autoscaling | default dict) "drain" $drain "drainSeconds" (int (ceil $drain)) "rayResources" $rayResources "maxOngoing" (int ($spec.max_ongoing_requests | default 256)) "maxQueued" (int (ternary $spec.max_queued_requests 512 (hasKey $spec "max_queued_requests"))) "override" $override "storage" $storage) -}}
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
A lane's or the spare's name, (dict "name" N "path" P "kind" K): it names the worker
group (KubeRay puts it in pod names and the ray.io/group label), its pods' spur.dev/group
label and its PodDisruptionBudget, so it must be a DNS-1123 label. spur's own schema is
looser (it allows '_' and a trailing '-'), which suits local mode.
*/}}
{{- define "spur.checkName" -}}
{{- $name := .name | default "" | toString -}}
{{- if not $name -}}
{{- fail (printf "%s has no name: give the %s a name (lowercase letters, digits and '-')" .path .kind) -}}
{{- end -}}
{{- if or (gt (len $name) 63) (not (regexMatch "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" $name)) -}}
{{- $fixed := regexReplaceAll "[^-a-z0-9]" ($name | lower) "-" | trunc 63 | trimAll "-" -}}
{{- fail (printf "%s.name: %q is not a DNS-1123 label (at most 63 lowercase letters, digits and '-', starting and ending with a letter or digit): on Kubernetes it names the %s's worker group, its pods and its PodDisruptionBudget; rename it, for example %q (and every reference to it: serves_lanes, groups.<name>)" .path $name .kind $fixed) -}}
{{- end -}}
{{- end -}}

{{/*
CPUs: one engine replica must fit in one pod of its group, as its GPUs must. What a
replica reserves is what spur.cluster.app._engine_deployment asks Ray for:
tensor_parallel_size 1: engine.runtime.num_threads (1 when unset); larger: 0.5 for the
replica plus, per rank, 1 on cuda and 0.5 otherwise. A pod offers its rayStartParams
num-cpus, else its CPU limit rounded up (as Ray's autoscaler reads it); with neither,
nothing is checked here (the autoscaler reports it).
(dict "spec" S "path" P "tp" N "device" D "override" O "workers" W)
*/}}
{{- define "spur.checkCpus" -}}
{{- $spec := .spec -}}
{{- $runtime := (($spec.engine | default dict).runtime | default dict) -}}
{{- $need := 0.0 -}}
{{- $why := "" -}}
{{- $lower := "" -}}
{{- if eq (int .tp) 1 -}}
{{- $need = float64 ($runtime.num_threads | default 1) -}}
{{- $why = printf "engine.runtime.num_threads is %v" ($runtime.num_threads | default "unset") -}}
{{- $lower = "lower engine.runtime.num_threads" -}}
{{- else -}}
{{- $need = addf 0.5 (mulf .tp (ternary 1.0 0.5 (eq .device "cuda"))) -}}
{{- $why = printf "0.5 for the replica plus %v per rank of tensor_parallel_size %d on %s" (ternary 1 0.5 (eq .device "cuda")) (int .tp) .device -}}
{{- $lower = "lower engine.parallelism.tensor_parallel_size" -}}
{{- end -}}
{{- $o := .override -}}
{{- $params := merge (dict) ($o.rayStartParams | default dict) (.workers.rayStartParams | default dict) -}}
{{- $limits := (($o.resources | default .workers.resources | default dict).limits | default dict) -}}
{{- $have := -1.0 -}}
{{- $from := "" -}}
{{- if hasKey $params "num-cpus" -}}
{{- $have = float64 (get $params "num-cpus") -}}
{{- $from = "its rayStartParams num-cpus" -}}
{{- else if hasKey $limits "cpu" -}}
{{- $q := toString $limits.cpu -}}
{{- if hasSuffix "m" $q -}}
{{- $have = ceil (divf (float64 (trimSuffix "m" $q)) 1000.0) -}}
{{- else -}}
{{- $have = ceil (float64 $q) -}}
{{- end -}}
{{- $from = printf "its CPU limit %s" $q -}}
{{- end -}}
{{- if and (ge $have 0.0) (gt $need $have) -}}
{{- fail (printf "%s: one engine replica reserves %v CPUs in Ray (%s), but a pod of worker group %s offers %v (%s), so no pod can hold one: raise groups.%s.resources.limits.cpu (or groups.%s.rayStartParams.num-cpus) to at least %v, or %s" .path $need $why $spec.name $have $from $spec.name $spec.name (ceil $need) $lower) -}}
{{- end -}}
{{- end -}}

{{/*
Environment of every Ray container. RAY_SERVE_PROXY_USE_GRPC follows server.data_plane
(the proxy's hop to the ingress), as `spur serve` sets it, and is always set: the image
sets it to 1, so object_ref needs an explicit 0.
*/}}
{{- define "spur.env" -}}
{{- $cfg := include "spur.configData" . | fromYaml -}}
- name: RAY_SERVE_PROXY_USE_GRPC
  value: {{ ternary "1" "0" (eq (($cfg.server | default dict).data_plane | default "grpc") "grpc") | quote }}
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
Volumes of a pod, (dict "volumes" L): Ray's object store in memory (/dev/shm: a
container's default 64 MiB would push it to disk) and the model storages in L, each
(dict "name" VOLUME "storage" S "owner" VALUES-PATH) with S a modelStorage of type pvc or
hostPath. Both are mounted read-only: a pvc needs an access mode that lets pods on
several nodes mount it (ReadOnlyMany or ReadWriteMany), and a hostPath is each node's
own folder.
*/}}
{{- define "spur.volumes" -}}
- name: shm
  emptyDir:
    medium: Memory
{{- range .volumes }}
{{- $s := .storage }}
- name: {{ .name }}
{{- if eq $s.type "pvc" }}
  persistentVolumeClaim:
    claimName: {{ required (printf "%s.claimName is required with type pvc: name the PersistentVolumeClaim holding the models" .owner) $s.claimName }}
    readOnly: true
{{- else if eq $s.type "hostPath" }}
  hostPath:
    path: {{ required (printf "%s.hostPath is required with type hostPath: give the models' folder on the nodes" .owner) $s.hostPath }}
    type: Directory
{{- end }}
{{- end }}
{{- end -}}

{{/*
Mounts of a pod, (dict "mounts" L): /dev/shm and each (dict "name" VOLUME "mountPath" P).
*/}}
{{- define "spur.volumeMounts" -}}
- name: shm
  mountPath: /dev/shm
{{- range .mounts }}
- name: {{ .name }}
  mountPath: {{ .mountPath }}
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
